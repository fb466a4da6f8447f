"""Prompts the bench sends: chat prompts of a chosen token count and a two-turn agent loop.

Prompts go through the chat renderer and the engine's own encoder, so what is measured is
what a client's request costs, template and special tokens included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ling3_rknn.chat import render

# Agent-like filler (shell lines, paths, numbers): tokenizes like a coding session rather
# than like one repeated word, which BPE would merge into unusually few tokens.
_LINE = "step {i}: ls -la src/pkg{m}/ && pytest -q tests/test_{m}.py && git diff --stat\n"

WEATHER_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"]}}},
]
AGENT_QUESTION = "What's the weather like in Lisbon?"
TOOL_RESULT = "18 degrees C, sunny"


def sized_prompt(count: Callable[[Sequence[Any]], int], target: int, tag: str
                 ) -> tuple[list[Any], int]:
    """Segments of a chat prompt with at most ``target`` tokens (as close as whole filler
    lines and words allow), and their token count. ``tag`` makes the system prompt unique
    so no earlier prompt's cached prefix turns the prefill into a cache hit."""
    words = "".join(_LINE.format(i=i, m=i % 37) for i in range(target)).split(" ")

    def build(n: int) -> list[Any]:
        system = {"role": "system", "content": f"Benchmark {tag}: summarise the session."}
        user = {"role": "user", "content": " ".join(words[:n])}
        return render([system, user], None, enable_thinking=False)

    lo, hi = 0, len(words)  # invariant: build(lo) fits; binary search on whole words
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    segments = build(lo)
    return segments, count(segments)


def agent_turn_one() -> list[dict[str, Any]]:
    """The first request of the loop: a question the agent answers with a tool call."""
    return [{"role": "user", "content": AGENT_QUESTION}]


def agent_turn_two(history: list[dict[str, Any]], assistant: dict[str, Any]
                   ) -> list[dict[str, Any]]:
    """Turn 2 as a client sends it: turn 1, the model's answer, then the tool results (or,
    when the model called nothing, a follow-up question)."""
    messages = [*history, assistant]
    calls = assistant.get("tool_calls") or []
    if not calls:
        return [*messages, {"role": "user", "content": "And tomorrow?"}]
    return [*messages, *({"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT}
                         for c in calls)]

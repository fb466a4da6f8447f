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

    segments = build(_largest_fitting(lambda n: count(build(n)), target, len(words)))
    return segments, count(segments)


def _largest_fitting(count_of: Callable[[int], int], target: int, most: int) -> int:
    """The largest n in [0, most] whose prompt has at most ``target`` tokens (binary search:
    the count grows with n; 0 when nothing fits)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_of(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


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


# opencode 1.18's first request, as measured against the demo server: a ~31K-character system
# prompt and 10 tool schemas, 16,604 tokens with the demo's vocabulary (README, agent
# clients). The bench rebuilds a prompt of that shape and size, not opencode's words.
OPENCODE_FIRST_REQUEST_TOKENS = 16_604
_AGENT_TOOLS = ("bash", "read", "write", "edit", "glob", "grep", "list", "webfetch",
                "todowrite", "task")
_GUIDELINE = ("- When {verb} files under src/{m}/, read the surrounding code first, keep the "
              "project's style, run `pytest -q tests/test_{m}.py` and report what changed "
              "in one short paragraph; never commit unless asked ({i}).\n")
_VERBS = ("editing", "creating", "moving", "reviewing", "refactoring", "testing")


def _agent_tool(name: str, i: int) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name,
        "description": f"Use {name} on a path of the repository ({i}).",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path of the file or folder"},
            "timeout": {"type": "integer", "description": "Milliseconds"},
        }, "required": ["path"]}}}


def agent_first_request(count: Callable[[Sequence[Any]], int], target: int, tag: str
                        ) -> tuple[list[Any], int, Callable[[str], list[Any]]]:
    """Segments of an agent's first request (a long system prompt of instructions, ten tool
    schemas, a short user question) of at most ``target`` tokens, its token count, and a
    function giving the same prefix with another user question (a next session of the same
    agent: only the question differs). ``tag`` opens the system prompt, so no earlier run's
    cache serves it."""
    tools = [_agent_tool(name, i) for i, name in enumerate(_AGENT_TOOLS)]
    lines = [_GUIDELINE.format(verb=_VERBS[i % len(_VERBS)], m=f"mod{i % 53}", i=i)
             for i in range(max(target, 1))]

    def build(n: int, question: str = "Fix the failing test in tests/test_mod7.py.") -> list[Any]:
        system = (f"Session {tag}. You are a coding agent working in a git repository. "
                  "Follow these rules:\n" + "".join(lines[:n]))
        return render([{"role": "system", "content": system},
                       {"role": "user", "content": question}], tools, enable_thinking=False)

    n = _largest_fitting(lambda k: count(build(k)), target, len(lines))
    segments = build(n)
    return segments, count(segments), lambda question: build(n, question)

"""Time to turn an opencode-sized request into token ids: render + encode_segments.

The request: a long system prompt, 20 tools with nested JSON-schema parameters and an agent
history of tool calls and file-sized tool results, about 48K characters, i.e. ~12K tokens for
Ling's 157K-entry vocabulary (~4 characters per token on English/code). The committed test
tokenizers have tiny vocabularies, so they produce more tokens for the same text; the figure
reported is for the ``ling-ids`` fixture and the token count it produces is printed too.

Run: ``.venv/bin/python tests/bench/bench_render_encode.py [--repeats 30] [--tokenizer PATH]``
Prints the median (and min/max) milliseconds of render alone and of render + encode, cold (empty
run cache) and for the next turn of an agent loop (the previous request's runs cached). Target
on the x86 dev host: <= 30 ms for the whole.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from ling3_rknn.chat import render
from ling3_rknn.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT / "fixtures" / "tokenizer" / "ling-ids" / "tokenizer.json"

SYSTEM_PARAGRAPH = (
    "You are opencode, an interactive CLI tool that helps users with software engineering "
    "tasks. Use the instructions below and the tools available to you to assist the user.\n"
    "IMPORTANT: Refuse to write code or explain code that may be used maliciously. Before you "
    "begin work, think about what the code you're editing is supposed to do based on the "
    "filenames and directory structure. When you run a non-trivial bash command, explain what "
    "the command does and why you are running it. Keep responses short; avoid preamble.\n"
)


def _tool(i: int) -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i:02d}",
            "description": (
                f"Tool {i}: reads, searches or edits files in the workspace. "
                "Usage notes: paths must be absolute; prefer batching independent calls; "
                "the output is truncated after 2000 lines. Ünïcödé names are allowed. "
            )
            * 3,
            "parameters": {
                "type": "object",
                "properties": {
                    "filePath": {"type": "string", "description": "The absolute path"},
                    "offset": {"type": "integer", "description": "Line to start at", "minimum": 0},
                    "limit": {"type": ["integer", "null"], "description": "Lines to read"},
                    "options": {
                        "type": "object",
                        "properties": {
                            "recursive": {"type": "boolean", "default": False},
                            "include": {
                                "type": "array",
                                "items": {
                                    "anyOf": [
                                        {"type": "string"},
                                        {
                                            "type": "object",
                                            "properties": {"glob": {"type": "string"}},
                                        },
                                    ]
                                },
                            },
                        },
                        "additionalProperties": False,
                    },
                },
                "required": ["filePath"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        },
    }


FILE_BODY = (
    "def handle(request):\n"
    '    """Validate the request and dispatch it to the right handler."""\n'
    "    if not request.user.is_authenticated:\n"
    "        raise PermissionError('login required')\n"
    "    payload = json.loads(request.body or '{}')\n"
    "    return dispatch(payload.get('action'), payload)\n\n"
)


def build_request(target_chars: int = 48_000) -> tuple[list[dict], list[dict]]:
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PARAGRAPH * 12},
        {"role": "user", "content": "Find why the login test fails and fix it, s'il te plaît."},
    ]
    tools = [_tool(i) for i in range(20)]
    turn = 0
    while len(json.dumps(messages)) + len(json.dumps(tools)) < target_chars:
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {
                "name": f"tool_{turn % 20:02d}",
                "arguments": json.dumps({"filePath": f"/repo/src/mod_{turn}.py", "limit": 200}),
            },
        }
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"Step {turn}: read the next module to trace the call.",
                "tool_calls": [call],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": FILE_BODY * 6})
        turn += 1
    return messages, tools


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _fmt(name: str, ms: list[float]) -> str:
    return (
        f"{name:40s} median {statistics.median(ms):7.2f} ms  (min {min(ms):.2f}, max {max(ms):.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    messages, tools = build_request()
    segments = render(messages, tools)
    text = "".join(s.text for s in segments)
    ids = tok.encode_segments(segments)
    print(
        f"request: {len(messages)} messages, {len(tools)} tools, {len(text)} characters, "
        f"{len(segments)} segments; {len(ids)} ids with {args.tokenizer.parent.name} "
        f"(~{len(text) // 4} at Ling's ~4 chars/token)"
    )
    # Agent-loop steady state: the previous request (all but the last assistant/tool pair) was
    # encoded a moment ago, so its runs are in the tokenizer's run cache.
    previous = messages[:-2]

    def cold() -> None:
        tok.clear_cache()
        tok.encode_segments(render(messages, tools))

    def warm_setup() -> None:
        tok.clear_cache()
        tok.encode_segments(render(previous, tools))

    # Baseline: the library alone encoding the finished string once (no trust boundary).
    from tokenizers import Tokenizer as LibraryTokenizer

    library = LibraryTokenizer.from_file(str(args.tokenizer))
    library_ms = _time(lambda: library.encode(text, add_special_tokens=False), args.repeats)
    render_ms = _time(lambda: render(messages, tools), args.repeats)
    cold_ms = _time(cold, args.repeats)
    warm_ms = []
    for _ in range(args.repeats):
        warm_setup()
        warm_ms += _time(lambda: tok.encode_segments(render(messages, tools)), 1)
    print(_fmt("baseline: tokenizers.encode(text)", library_ms))
    print(_fmt("render", render_ms))
    print(_fmt("render+encode cold (empty run cache)", cold_ms))
    print(_fmt("render+encode next agent turn (warm)", warm_ms))
    print(f"host load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

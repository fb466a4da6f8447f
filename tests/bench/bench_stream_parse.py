"""Cost of the streaming parser per decoded token, on a long agent turn.

The turn: reasoning, a short answer and a ``write`` call whose string argument is a ~12K
character file, fed in ~4-character deltas (one token each), which is the worst case for the
held-back call block: it grows until ``</tool_call>`` arrives.

Run: ``.venv/bin/python tests/bench/bench_stream_parse.py [--repeats 5]``
Prints microseconds per delta (median over repeats) and the whole-turn time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ling3_rknn.chat import StreamingParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {"filePath": {"type": "string"}, "content": {"type": "string"}},
                "required": ["filePath", "content"],
            },
        },
    }
]


def build_turn() -> str:
    body = "def f(x):\n    return x * 2  # <tool_call> inside a value is fine\n" * 200
    return (
        "The user wants a new module. I will write it in one go. "
        * 20
        + "</think>Writing the file now.\n<tool_call>write\n<arg_key>filePath</arg_key>\n"
        "<arg_value>/repo/mod.py</arg_value><arg_key>content</arg_key>\n<arg_value>"
        + body
        + "</arg_value>\n</tool_call>"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    text = build_turn()
    deltas = [text[i : i + 4] for i in range(0, len(text), 4)]
    totals = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        p = StreamingParser(TOOLS)
        for d in deltas:
            p.feed(d)
        p.finish()
        totals.append(time.perf_counter() - t0)
    assert p.result().tool_calls[0].arguments["filePath"] == "/repo/mod.py"
    med = statistics.median(totals)
    print(f"turn: {len(text)} characters, {len(deltas)} deltas")
    print(f"whole turn median {med * 1000:.1f} ms; {med / len(deltas) * 1e6:.1f} us per delta")


if __name__ == "__main__":
    main()

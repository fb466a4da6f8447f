"""The demo bundle's greedy answers to a fixed set of requests, through ``ling3-rknn serve``
and the official openai SDK; with ``--compare``, held token for token to another machine's.

The aarch64 tier (tests/aarch64/run.sh) records the answers on the x86 host and compares
the emulated board's with them: the same bundle, engine and sampler, so any difference
comes from the machine (the NEON/_Float16 kernels, the aarch64 numpy, onnxruntime and
tokenizers builds). Usage::

    python tests/aarch64/greedy_answers.py --out x86.json
    python tests/aarch64/greedy_answers.py --out arm.json --compare x86.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai

MODEL = "ling-3.0-tiny-demo"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current local time in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"]}}},
]
TOOL_RESULTS = {"get_weather": "18 degrees C, sunny", "get_time": "14:05"}
# Plain prompts (no tools), one long enough for several prefill chunks (the prefill
# attention kernel over earlier rows) and a decode at depth.
PLAIN = [
    "Hello! Who are you?",
    "Tell me something about Lisbon.",
    "Summarise this log and say what failed:\n"
    + "".join(f"step {i}: pytest tests/test_{i % 7}.py ... {'ok' if i % 5 else 'FAILED'}\n"
              for i in range(60)),
]
TOOL_QUESTIONS = ["What's the weather like in Lisbon?", "What time is it in New York?"]
MAX_TOKENS = 48
LOAD_TIMEOUT_S = 1800  # emulated: every instruction of a load goes through qemu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before /health")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise SystemExit(f"/health not 200 after {timeout:.0f} s")


def _answer(done: Any) -> dict[str, Any]:
    """What must agree across machines: the text, the calls, why it stopped, the counts
    (ids and timestamps differ by design)."""
    choice = done.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    # the reasoning the server returns beside the content (a field the SDK keeps as extra)
    extra = {k: v for k, v in (choice.message.model_extra or {}).items() if v is not None}
    return {"content": choice.message.content, "tool_calls": calls, **extra,
            "finish_reason": choice.finish_reason,
            "prompt_tokens": done.usage.prompt_tokens,
            "completion_tokens": done.usage.completion_tokens}


def ask_all(base: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                           timeout=1800)
    answers: dict[str, Any] = {}
    try:
        for prompt in PLAIN:
            done = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS)
            answers[f"plain: {prompt[:40]}"] = _answer(done)
        for question in TOOL_QUESTIONS:
            # the round trip: the model calls a tool, the result goes back, it answers
            messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
            first = client.chat.completions.create(model=MODEL, messages=messages,
                                                   tools=TOOLS, max_tokens=MAX_TOKENS)
            turn = [_answer(first)]
            choice = first.choices[0]
            if choice.message.tool_calls:
                call = choice.message.tool_calls[0]
                messages += [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id,
                              "content": TOOL_RESULTS.get(call.function.name, "unknown")}]
                second = client.chat.completions.create(model=MODEL, messages=messages,
                                                        tools=TOOLS, max_tokens=MAX_TOKENS)
                turn.append(_answer(second))
            answers[f"tools: {question}"] = turn
    finally:
        client.close()
    return answers


def serve_and_ask(ling3_rknn: list[str]) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "LING3_RKNN_STATE_DIR": os.environ.get(
            "LING3_RKNN_STATE_DIR", state)}
        env.pop("LING3_RKNN_API_KEY", None)
        # fixed threads: the split of the attention over threads is part of the rounding
        server = subprocess.Popen([*ling3_rknn, "--log-level", "warning", "serve", "--port",
                                   str(port), "--threads", "2"], env=env)
        try:
            wait_healthy(base, server, LOAD_TIMEOUT_S)
            return ask_all(base)
        finally:
            server.terminate()
            server.wait(timeout=120)


def compare(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """One line per request that differs (empty: every answer equal)."""
    return [f"{key}:\n  here:  {json.dumps(mine.get(key))}\n  there: {json.dumps(value)}"
            for key, value in theirs.items() if mine.get(key) != value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="answers as JSON")
    parser.add_argument("--compare", type=Path, help="another machine's --out to equal")
    parser.add_argument("--ling3-rknn", help="the ling3-rknn command (default: this Python's)")
    args = parser.parse_args()
    command = ([args.ling3_rknn] if args.ling3_rknn
               else [shutil.which("ling3-rknn", path=str(Path(sys.executable).parent))
                     or "ling3-rknn"])
    answers = serve_and_ask(command)
    args.out.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n")
    requests = sum(len(v) if isinstance(v, list) else 1 for v in answers.values())
    print(f"{requests} greedy answers recorded in {args.out}")
    if args.compare is None:
        return 0
    differing = compare(answers, json.loads(args.compare.read_text()))
    if differing:
        print(f"{len(differing)} of {len(answers)} prompts answered differently:", *differing,
              sep="\n")
        return 1
    tokens = sum(a["completion_tokens"] for v in answers.values()
                 for a in (v if isinstance(v, list) else [v]))
    print(f"greedy agreement with {args.compare.name}: {len(answers)} of {len(answers)} "
          f"prompts, {requests} requests, {tokens} generated tokens identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())

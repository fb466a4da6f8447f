"""The Responses and Anthropic Messages routes measured against the chat route (figures
for docs/serving.md 10; never asserted in tests).

1. Per streamed token, what each route adds over the chat route on the same request: the
   scripted engine (zero model cost) streams N one-token pieces of answer text through
   the real renderer, parser, shared flow, each route's writer and the HTTP stack to an
   aiohttp client in the same process; the routes take turns, several rounds, and the
   best round of each counts (the machine is shared).
2. Time to first token of Codex's first request and of its second (cached) one on the
   embedded demo model: the body codex-cli 0.171.0 sent (tests/fixtures/clients), then
   the same conversation with the answer and a follow-up question appended, as Codex
   sends it. TTFT = request sent to the first event carrying model output.

Run: ``.venv/bin/python tests/bench/bench_server_apis.py [--tokens 4000] [--skip-real]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripted_engine import ScriptedEngine
from server_harness import running_server

MODEL = "ling-3.0-tiny"
CODEX_REQUEST = (Path(__file__).resolve().parents[1] / "fixtures" / "clients"
                 / "codex-0.171.0-first-request.json")
ROUTES = {
    "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                   "chat_template_kwargs": {"enable_thinking": False}}),
    "responses": ("/responses", {"input": "hi", "reasoning": {"effort": "none"}}),
    "messages": ("/messages", {"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 100_000}),
}
_OPENING = (b"response.created", b"response.in_progress", b"message_start", b"ping")


async def stream(session: aiohttp.ClientSession, url: str, body: dict,
                 final: list | None = None) -> tuple[int, float]:
    """(data events, seconds to the first one carrying model output); the last event's
    payload is appended to ``final`` when given."""
    started = time.perf_counter()
    first = None
    events = 0
    last = b""
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            last = line
            if b'"error"' in line[:40] or b"response.failed" in line[:60]:
                raise RuntimeError(line.decode())
            if first is None and not any(o in line[:60] for o in _OPENING) and (
                    b'"role": "assistant", "content": null' not in line):
                first = time.perf_counter() - started
    if final is not None:
        final.append(json.loads(last[len(b"data: "):]))
    return events, first or 0.0


async def bench_per_token(tokens: int, rounds: int) -> dict:
    engine = ScriptedEngine(max_context=10**9)
    runs: dict[str, list[float]] = {name: [] for name in ROUTES}
    async with running_server(engine) as srv, aiohttp.ClientSession() as session:
        for path, body in ROUTES.values():  # warm-up
            engine.push("warm ", "up")
            await stream(session, srv.v1 + path, {"model": MODEL, "stream": True, **body})
        for r in range(rounds):
            order = list(ROUTES)[r % 3:] + list(ROUTES)[:r % 3]
            for name in order:
                path, body = ROUTES[name]
                engine.push(*[f"w{i % 10} " for i in range(tokens)])
                started = time.perf_counter()
                events, _ = await stream(session, srv.v1 + path,
                                         {"model": MODEL, "stream": True, **body})
                elapsed = time.perf_counter() - started
                assert events >= tokens, (name, events, tokens)
                runs[name].append(elapsed / tokens * 1000)
    best = {name: min(values) for name, values in runs.items()}
    return {
        "tokens": tokens,
        "ms_per_token": {name: round(v, 4) for name, v in best.items()},
        "ms_per_token_over_chat": {name: round(v - best["chat"], 4)
                                   for name, v in best.items() if name != "chat"},
        "runs": {name: [round(v, 4) for v in values] for name, values in runs.items()},
    }


async def bench_codex_ttft() -> dict:
    from ling3_rknn.demo import DEMO_MODEL_ID, load_demo_engine

    engine = load_demo_engine()
    try:
        body = json.loads(CODEX_REQUEST.read_text())["body"]
        body["model"] = DEMO_MODEL_ID
        out: dict = {}
        async with running_server(engine) as srv, aiohttp.ClientSession() as session:
            url = srv.v1 + "/responses"
            done: list = []
            _, first = await stream(session, url, body, done)
            answer = done[-1]["response"]  # response.completed: the output Codex keeps
            usage1 = answer["usage"]
            second_body = {**body, "input": [
                *body["input"], *answer["output"],
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "And in Porto?"}]}]}
            _, second = await stream(session, url, second_body, done)
            usage2 = done[-1]["response"]["usage"]
        out["first_request"] = {"ttft_ms": round(first * 1000, 1),
                                "input_tokens": usage1["input_tokens"]}
        out["second_request"] = {
            "ttft_ms": round(second * 1000, 1), "input_tokens": usage2["input_tokens"],
            "cached_tokens": usage2["input_tokens_details"]["cached_tokens"]}
        return out
    finally:  # a live worker thread at interpreter exit aborts onnxruntime's teardown
        await asyncio.to_thread(engine.close)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args()
    figures = {"per_token": await bench_per_token(args.tokens, args.rounds)}
    if not args.skip_real:
        figures["codex_ttft_demo"] = await bench_codex_ttft()
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    asyncio.run(main())

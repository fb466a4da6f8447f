"""Server benchmarks (figures for the issue; never asserted in tests).

1. Server overhead per streamed token: the scripted engine (zero model cost) streams N
   one-token pieces through the real renderer, parser, SSE writer and HTTP stack to an
   aiohttp client in the same process; time per token is an upper bound of the server's
   own cost (the client's parsing is included).
2. Time to first token, prefix-cache miss vs hit: the embedded demo bundle (trained tiny
   Ling-3.0, stage graphs on the RKNNLite mock, int4 QMoE experts) through the real
   engine; TTFT = time from request to the first chunk after the role chunk, with
   ``max_tokens=1``.
3. Requests/s for 16 concurrent non-stream clients, on both engines; every response is
   checked (status 200, one choice, usage) and counted.

Run: ``.venv/bin/python tests/bench/bench_server.py [--tokens 4000] [--skip-real]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripted_engine import ScriptedEngine
from server_harness import running_server

from ling3_rknn.server import AppConfig

MODEL = "ling-3.0-tiny"


async def stream_once(session: aiohttp.ClientSession, url: str, payload: dict) -> tuple[int, float]:
    """(data events received, seconds to the first event after the role chunk)."""
    started = time.perf_counter()
    first_after_role = None
    events = 0
    async with session.post(url, json=payload) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            if events == 2 and first_after_role is None:
                first_after_role = time.perf_counter() - started
            if line.startswith(b"data: {") and b'"error"' in line[:20]:
                raise RuntimeError(line.decode())
    return events, first_after_role or 0.0


async def bench_stream_overhead(tokens: int) -> dict:
    engine = ScriptedEngine()
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    async with running_server(engine) as srv, aiohttp.ClientSession() as session:
        url = srv.v1 + "/chat/completions"
        engine.push("warm ", "up")
        await stream_once(session, url, payload)
        runs = []
        for _ in range(3):
            engine.push(*[f"w{i % 10} " for i in range(tokens)])
            started = time.perf_counter()
            events, _ = await stream_once(session, url, payload)
            elapsed = time.perf_counter() - started
            assert events >= tokens, (events, tokens)
            runs.append(elapsed / tokens * 1000)
    return {
        "tokens": tokens,
        "ms_per_token_runs": [round(r, 4) for r in runs],
        "ms_per_token": round(min(runs), 4),
    }


async def bench_concurrency(engine, clients: int, per_client: int, payload: dict) -> dict:
    async with running_server(engine, AppConfig()) as srv:
        url = srv.v1 + "/chat/completions"
        results: list[int] = []
        errors: list[str] = []
        connector = aiohttp.TCPConnector(limit=clients)
        timeout = aiohttp.ClientTimeout(total=600)

        async def client(session: aiohttp.ClientSession) -> None:
            for _ in range(per_client):
                async with session.post(url, json=payload) as response:
                    text = await response.text()
                    if response.status != 200:
                        errors.append(f"{response.status}: {text[:200]}")
                        continue
                    body = json.loads(text)
                    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] >= 1
                    results.append(response.status)

        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            started = time.perf_counter()
            await asyncio.gather(*(client(session) for _ in range(clients)))
            elapsed = time.perf_counter() - started
    total = clients * per_client
    return {
        "clients": clients,
        "requests": total,
        "ok": len(results),
        "errors": len(errors),
        "lost": total - len(results) - len(errors),
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(results) / elapsed, 2),
        "first_errors": errors[:3],
    }


async def bench_real(clients: int, per_client: int) -> dict:
    from ling3_rknn.demo import load_demo_engine
    from ling3_rknn.loading import LoadOptions

    engine = load_demo_engine(LoadOptions(model_id=MODEL))
    try:
        return await _bench_real(engine, clients, per_client)
    finally:  # a live worker thread at interpreter exit aborts onnxruntime's teardown
        await asyncio.to_thread(engine.close)


async def _bench_real(engine, clients: int, per_client: int) -> dict:
    system = "You are a careful assistant for a coding agent. " * 40
    out: dict = {}
    async with running_server(engine) as srv, aiohttp.ClientSession() as session:
        url = srv.v1 + "/chat/completions"
        miss, hit = [], []
        for i in range(3):
            messages = [
                {"role": "system", "content": f"[{i}] {system}"},
                {"role": "user", "content": "Summarise the rules."},
            ]
            payload = {
                "model": MODEL,
                "messages": messages,
                "stream": True,
                "max_tokens": 1,
                "temperature": 0,
            }
            miss.append((await stream_once(session, url, payload))[1])
            hit.append((await stream_once(session, url, payload))[1])
        stats = engine.stats()
        out["ttft_ms"] = {
            "prompt_chars": len(system) + 40,
            "miss_median": round(statistics.median(miss) * 1000, 1),
            "hit_median": round(statistics.median(hit) * 1000, 1),
            "miss_runs": [round(x * 1000, 1) for x in miss],
            "hit_runs": [round(x * 1000, 1) for x in hit],
            "engine_cache_hits": stats.cache_hits,
            "engine_cache_tokens_reused": stats.cache_tokens_reused,
        }
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    out["concurrency_real"] = await bench_concurrency(engine, clients, per_client, payload)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=8)
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args()
    figures: dict = {"stream_overhead": await bench_stream_overhead(args.tokens)}
    scripted = ScriptedEngine()
    scripted.max_waiting = args.clients
    scripted.default.pieces = ["Hello"] * 16
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    figures["concurrency_scripted"] = await bench_concurrency(
        scripted, args.clients, args.per_client, payload
    )
    if not args.skip_real:
        figures.update(await bench_real(args.clients, args.per_client))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    asyncio.run(main())

"""Fleet benchmark: the shipped deploy/haproxy.cfg in front of three `ling3-rknn serve`
processes on the embedded demo bundle, on loopback (figures for issue 16; never asserted
in tests, see tests/test_deploy_haproxy.py for the behaviour).

1. Prefix-cache hit rate over 6 conversations x 3 turns: through HAProxy (hashed on
   prompt_cache_key), direct with each conversation pinned to one board (the ideal), and
   direct round robin over the boards (what a balancer without affinity gives).
   Hit rate = cached prompt tokens / prompt tokens over turns 2 and 3; "warm" = turns whose
   cached tokens cover the whole previous prompt.
2. Requests lost while a board is stopped with SIGTERM: 6 conversations run back to back
   (non-stream and stream) while the busiest board is stopped, with the shipped drain
   (--drain-seconds 6) and without one (0); every request that did not end in a complete
   answer is lost. Retries HAProxy made are read from its log.
3. Latency HAProxy adds, measured in one run against the same board directly, requests
   interleaved: per non-stream request (max_tokens 1, prompt from the prefix cache) and per
   streamed token (mean gap between content events of a 64-token stream), as ratios.

Run: ``.venv/bin/python tests/bench/bench_fleet.py [--json OUT] [--rounds 40]``
(needs haproxy: ``make system-tools``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_deploy_haproxy import HAPROXY, MODEL, Conversation, Fleet, chat, local_fleet


def fresh_conversations(tag: str, n: int = 6) -> list[Conversation]:
    """Conversations whose prompts no board has seen (beyond the shared system prompt)."""
    cities = ("Lisbon", "Porto", "Madrid", "Oslo", "Berlin", "Rome")
    convs = []
    for i in range(n):
        c = Conversation(f"{tag}-{i}", cities[i], stream=i % 2 == 1)
        c.messages[1]["content"] = f"{tag}: what is the weather in {cities[i]}?"
        convs.append(c)
    return convs


def hit_figures(convs: list[Conversation]) -> dict:
    later = [(before, turn) for c in convs for before, turn in itertools.pairwise(c.turns)]
    cached = sum(t.cached_tokens for _, t in later)
    prompt = sum(t.prompt_tokens for _, t in later)
    warm = sum(t.cached_tokens >= b.prompt_tokens for b, t in later)
    return {"hit_rate": round(cached / prompt, 3), "warm_turns": f"{warm}/{len(later)}",
            "cached_tokens": cached, "prompt_tokens": prompt}


async def bench_hit_rate(fleet: Fleet, session: aiohttp.ClientSession) -> dict:
    out = {}
    boards = [b.base for b in fleet.boards]
    # HAProxy, hashed on prompt_cache_key.
    convs = fresh_conversations("via-haproxy")
    for _ in range(3):
        await asyncio.gather(*(c.step(session, fleet.base) for c in convs))
    out["haproxy"] = hit_figures(convs)
    out["haproxy"]["boards_used"] = sorted({t.board for c in convs for t in c.turns})
    # Direct, each conversation pinned to one board.
    convs = fresh_conversations("pinned")
    for _ in range(3):
        await asyncio.gather(*(c.step(session, boards[i % len(boards)])
                               for i, c in enumerate(convs)))
    out["direct_pinned"] = hit_figures(convs)
    # Direct, round robin: turn t of conversation i goes to board (i + t) mod 3.
    convs = fresh_conversations("round-robin")
    for turn in range(3):
        await asyncio.gather(*(c.step(session, boards[(i + turn) % len(boards)])
                               for i, c in enumerate(convs)))
    out["direct_round_robin"] = hit_figures(convs)
    return out


async def bench_stop(workdir: Path, drain_s: float, turns: int = 10) -> dict:
    """6 conversations x ``turns`` turns; the busiest board gets SIGTERM after turn 3."""
    lost: list[str] = []
    sent = 0
    async with local_fleet(workdir, drain_s=drain_s) as fleet, \
            aiohttp.ClientSession() as session:
        convs = fresh_conversations(f"stop-drain-{drain_s:g}")

        async def run(c: Conversation, n: int) -> None:
            nonlocal sent
            for _ in range(n):
                sent += 1
                try:
                    # streams long enough to be under way when the signal lands
                    await c.step(session, fleet.base, max_tokens=24)
                except Exception as exc:  # every failure is a lost request
                    lost.append(f"{c.key}: {str(exc)[:160]}")

        await asyncio.gather(*(run(c, 3) for c in convs))
        counts: dict[str, int] = {}
        for c in convs:
            counts[c.turns[-1].board] = counts.get(c.turns[-1].board, 0) + 1
        victim = fleet.board(max(counts, key=counts.__getitem__))
        rest = asyncio.gather(*(run(c, turns - 3) for c in convs))
        await asyncio.sleep(0.05)  # the next turns are in flight
        stopped = time.monotonic()
        victim.process.send_signal(signal.SIGTERM)

        async def seconds_to_down() -> float:
            await fleet.wait_status(session, victim.name, "DOWN")
            return time.monotonic() - stopped

        watch = asyncio.create_task(seconds_to_down())
        await rest
        down_s = await watch
        exit_code = await asyncio.to_thread(victim.process.wait, 60)
    log = (workdir / "haproxy.log").read_text()
    lines = re.findall(r" boards/(\S+) \S+ (\d{3}) .* \d+/\d+/\d+/\d+/(\+?\d+) ", log)
    return {
        "drain_seconds": drain_s,
        "requests": sent,
        "lost": len(lost),
        "lost_detail": lost[:5],
        "conversations_on_stopped_board": counts[victim.name],
        "retried_by_haproxy": sum(r != "0" for _, _, r in lines),
        "redispatched": sum(r.startswith("+") for _, _, r in lines),
        "seconds_to_DOWN_in_stats": round(down_s, 2),
        "stopped_board_exit_code": exit_code,
    }


async def _timed_request(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.perf_counter() - started


async def _timed_stream(session: aiohttp.ClientSession, url: str,
                        body: dict) -> tuple[int, float, float]:
    """(text events, seconds to the first, seconds from the first to the last)."""
    started = time.perf_counter()
    stamps = []
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            if raw.startswith(b"data: {"):
                now = time.perf_counter()
                delta = json.loads(raw[len(b"data: "):])["choices"][0]["delta"]
                if delta.get("content") or delta.get("reasoning_content"):
                    stamps.append(now)
    return len(stamps), stamps[0] - started, stamps[-1] - stamps[0]


async def bench_latency(fleet: Fleet, session: aiohttp.ClientSession, rounds: int) -> dict:
    key = "latency-probe"
    messages = [{"role": "user", "content": "Tell me about the weather in Lisbon today."}]
    probe = await chat(session, fleet.base, messages, key=key, max_tokens=1)
    direct = fleet.board(probe.board).base  # the board HAProxy sends this key to
    small = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0,
             "prompt_cache_key": key}
    stream = {**small, "max_tokens": 64, "stream": True}
    req = {"direct": [], "haproxy": []}
    tok = {"direct": [], "haproxy": []}
    ttft = {"direct": [], "haproxy": []}
    events = {"direct": [], "haproxy": []}
    for i in range(rounds + 3):  # interleaved, order alternating; 3 warm-up rounds
        order = [("direct", direct), ("haproxy", fleet.base)]
        if i % 2:
            order.reverse()
        for name, url in order:
            t = await _timed_request(session, url, small)
            n, first, rest = await _timed_stream(session, url, stream)
            if i >= 3:
                req[name].append(t)
                ttft[name].append(first)
                events[name].append(n)
                tok[name].append(rest / max(n - 1, 1))
    def ms(a: float, b: float) -> float:
        return round((a - b), 4)

    med = {k: {"request_ms": statistics.median(req[k]) * 1e3,
               "stream_ttft_ms": statistics.median(ttft[k]) * 1e3,
               "per_token_ms": statistics.median(tok[k]) * 1e3,
               "tokens_per_stream": statistics.median(events[k])} for k in req}
    return {
        "board": probe.board, "rounds": rounds,
        "direct": {k: round(v, 3) for k, v in med["direct"].items()},
        "haproxy": {k: round(v, 3) for k, v in med["haproxy"].items()},
        "added_ms_per_request": ms(med["haproxy"]["request_ms"], med["direct"]["request_ms"]),
        "ratio_per_request": round(med["haproxy"]["request_ms"] / med["direct"]["request_ms"], 3),
        "added_ms_per_token": ms(med["haproxy"]["per_token_ms"], med["direct"]["per_token_ms"]),
        "ratio_per_token": round(med["haproxy"]["per_token_ms"] / med["direct"]["per_token_ms"], 3),
        "ratio_ttft": round(med["haproxy"]["stream_ttft_ms"] / med["direct"]["stream_ttft_ms"], 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if HAPROXY is None:
        sys.exit("haproxy not installed (make system-tools)")
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_fleet") as tmp:
        work = Path(tmp)
        (work / "main").mkdir()
        async with local_fleet(work / "main") as fleet, aiohttp.ClientSession() as session:
            report["hit_rate"] = await bench_hit_rate(fleet, session)
            report["latency"] = await bench_latency(fleet, session, args.rounds)
        for drain in (6.0, 0.0):
            sub = work / f"stop{drain:g}"
            sub.mkdir()
            report[f"stop_drain_{drain:g}s"] = await bench_stop(sub, drain)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())

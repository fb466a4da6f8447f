"""The shipped ``deploy/haproxy.cfg`` in front of three real ``ling3-rknn serve`` processes
(the embedded demo bundle) on loopback.

HAProxy runs the file as shipped: the test only sets the environment variables the file
reads (listen addresses, the boards' ports, a fast health-check interval). Checked here:
conversations keyed by ``prompt_cache_key`` stay on one board (every later turn is answered
from that board's prefix cache), the header fallbacks route the same way, and a board
stopped with SIGTERM mid-run drains: its running requests finish there, new ones go to
another board, no request fails, and HAProxy's stats show it DOWN; a board whose queue is
full answers 503 + Retry-After, which HAProxy resends to another board.

Needs the Debian ``haproxy`` package (``make system-tools`` installs it); skipped without.
Figures (hit rate, HAProxy's added latency): ``tests/bench/bench_fleet.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import grp
import io
import itertools
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

CFG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy.cfg"
# Debian installs it in /usr/sbin, which a non-root PATH may lack.
HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
MODEL = "ling-3.0-tiny-demo"
SYSTEM = "You are a weather agent. Answer briefly."
CITIES = ("Lisbon", "Porto", "Madrid", "Oslo", "Berlin", "Rome", "Vienna", "Prague")

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(HAPROXY is None,
                                 reason="haproxy not installed (make system-tools)")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(log: Path, pattern: str, process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if process.poll() is not None:
            raise AssertionError(f"{log.name}: exited with {process.returncode}:\n"
                                 + log.read_text(errors="replace")[-2000:])
        time.sleep(0.02)
    raise AssertionError(f"{log.name}: no {pattern!r} within {timeout} s")


@dataclass
class Board:
    name: str  # the cfg's server name: board1, board2, ...
    process: subprocess.Popen
    log: Path
    port: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Fleet:
    boards: list[Board]
    haproxy: subprocess.Popen
    base: str  # HAProxy's frontend
    stats: str  # HAProxy's stats page
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)

    def board(self, name: str) -> Board:
        return next(b for b in self.boards if b.name == name)

    async def server_status(self, session: aiohttp.ClientSession) -> dict[str, str]:
        """svname -> status (UP, DOWN, MAINT, "UP 1/2", ...) from the stats CSV."""
        async with session.get(self.stats + "/stats;csv") as r:
            assert r.status == 200
            text = (await r.text()).lstrip("# ")
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text))
                if row["pxname"] == "boards" and row["svname"] not in ("BACKEND", "FRONTEND")}

    async def wait_status(self, session: aiohttp.ClientSession, name: str, status: str,
                          timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            got = (await self.server_status(session)).get(name)
            if got == status:
                return
            assert time.monotonic() < deadline, f"{name} is {got}, not {status}"
            await asyncio.sleep(0.05)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@contextlib.asynccontextmanager
async def local_fleet(workdir: Path, n: int = 3, drain_s: float = 6.0,
                      check_inter: str = "300ms",
                      serve_args: tuple[str, ...] = ()) -> AsyncIterator[Fleet]:
    """``n`` demo servers on loopback and HAProxy (the shipped cfg) in front of them."""
    assert n <= 3, "the shipped cfg names three boards"
    env = {k: v for k, v in os.environ.items() if k != "LING3_RKNN_API_KEY"}
    env["PYTHONUNBUFFERED"] = "1"
    boards: list[Board] = []
    haproxy = None
    try:
        for i in range(1, n + 1):
            log = workdir / f"board{i}.log"
            with log.open("w") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "ling3_rknn.cli", "serve", "--port", "0",
                     "--threads", "1", "--drain-seconds", str(drain_s), *serve_args],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
            boards.append(Board(f"board{i}", process, log))
        for board in boards:
            board.port = int(await asyncio.to_thread(
                _wait_for_line, board.log, r"listening on http://127\.0\.0\.1:(\d+)",
                board.process, 60))
        async with aiohttp.ClientSession() as session:
            for board in boards:  # /health: 503 loading, then 200
                deadline = time.monotonic() + 60
                while True:
                    async with session.get(board.base + "/health") as r:
                        if r.status == 200:
                            break
                        assert r.status == 503 and (await r.json())["status"] == "loading"
                    assert time.monotonic() < deadline, "the demo model did not load"
                    await asyncio.sleep(0.05)
        front, stats = free_port(), free_port()
        # The stats socket's path must stay short (sun_path is 108 bytes).
        sock_dir = Path(tempfile.mkdtemp(prefix="l3hap"))
        hap_env = {
            **env,
            "LING3_LISTEN": f"127.0.0.1:{front}",
            "LING3_STATS_LISTEN": f"127.0.0.1:{stats}",
            "LING3_STATS_SOCKET": str(sock_dir / "admin.sock"),
            "LING3_CHECK_INTER": check_inter,
        }
        if os.geteuid() != 0:  # only root can switch to the cfg's haproxy user
            hap_env["LING3_HAPROXY_USER"] = pwd.getpwuid(os.getuid()).pw_name
            hap_env["LING3_HAPROXY_GROUP"] = grp.getgrgid(os.getgid()).gr_name
        for i in range(1, 4):
            # A board the test does not start points at a closed port: it stays DOWN.
            port = boards[i - 1].port if i <= n else free_port()
            hap_env[f"LING3_BOARD{i}"] = f"127.0.0.1:{port}"
        log = workdir / "haproxy.log"
        with log.open("w") as out:
            haproxy = subprocess.Popen([HAPROXY, "-db", "-f", str(CFG)], stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT, env=hap_env)
        fleet = Fleet(boards, haproxy, f"http://127.0.0.1:{front}", f"http://127.0.0.1:{stats}",
                      workdir, hap_env)
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    status = await fleet.server_status(session)
                    if all(status.get(b.name) == "UP" for b in boards):
                        break
                assert haproxy.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "HAProxy never saw the boards UP"
                await asyncio.sleep(0.05)
        yield fleet
    finally:
        if haproxy is not None:
            _stop(haproxy)
            shutil.rmtree(sock_dir, ignore_errors=True)
        for board in boards:
            _stop(board.process)


@dataclass
class Turn:
    board: str
    prompt_tokens: int
    cached_tokens: int
    text: str


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], *,
               key: str | None = None, stream: bool = False, max_tokens: int = 6,
               headers: dict[str, str] | None = None,
               started: asyncio.Event | None = None) -> Turn:
    """One chat completion; any failure (HTTP error, error event, no usage) raises."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}
    if key is not None:
        body["prompt_cache_key"] = key
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise AssertionError(f"HTTP {r.status}: {await r.text()}")
        board = r.headers.get("x-ling3-board", url)  # HAProxy names the board; direct: url
        if not stream:
            data = await r.json()
            usage = data["usage"]
            text = data["choices"][0]["message"]["content"] or ""
        else:
            if started is not None:
                started.set()
            usage, pieces, done = None, [], False
            async for raw in r.content:
                line = raw.decode().rstrip("\n")
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                for choice in event["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
                usage = event.get("usage") or usage
            assert done and usage is not None, "the stream did not finish"
            text = "".join(pieces)
    return Turn(board, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                text)


@dataclass
class Conversation:
    key: str
    city: str
    stream: bool
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"What is the weather in {self.city}?"}]

    async def step(self, session: aiohttp.ClientSession, url: str, **kw: Any) -> Turn:
        turn = await chat(session, url, self.messages, key=self.key,
                          stream=kw.pop("stream", self.stream), **kw)
        self.turns.append(turn)
        n = len(self.turns)
        self.messages += [{"role": "assistant", "content": turn.text},
                          {"role": "user", "content": f"And in {n} days in {self.city}?"}]
        return turn


def conversations(n: int = 6) -> list[Conversation]:
    return [Conversation(f"agent-{i}-{CITIES[i]}", CITIES[i], stream=i % 2 == 1)
            for i in range(n)]


def assert_warm(turns: list[Turn]) -> None:
    """Each turn after the first on the same board, its prompt up to the previous turn's
    end answered by that board's prefix cache."""
    for before, turn in itertools.pairwise(turns):
        assert turn.board == before.board, [t.board for t in turns]
        assert turn.cached_tokens >= before.prompt_tokens, (before, turn)


async def test_conversations_stay_on_their_board_and_survive_a_board_stop(tmp_path):
    async with local_fleet(tmp_path) as fleet, aiohttp.ClientSession() as session:
        convs = conversations()
        for _ in range(3):  # 6 conversations x 3 turns, the conversations concurrently
            await asyncio.gather(*(c.step(session, fleet.base) for c in convs))
        for c in convs:
            assert c.turns[0].cached_tokens < c.turns[0].prompt_tokens
            assert_warm(c.turns)

        # Stop the board with the most conversations while its requests are running.
        counts = {b.name: sum(c.turns[-1].board == b.name for c in convs) for b in fleet.boards}
        victim = fleet.board(max(counts, key=counts.__getitem__))
        moved = [c for c in convs if c.turns[-1].board == victim.name]
        stayed = [c for c in convs if c not in moved]
        assert moved
        # Turn 4 streams: the victim's first stream has its headers when SIGTERM arrives.
        started = asyncio.Event()
        running = [asyncio.create_task(c.step(session, fleet.base, stream=True, max_tokens=16,
                                              started=started if c is moved[0] else None))
                   for c in convs]
        await asyncio.wait_for(started.wait(), 30)
        victim.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*running)  # every request answered
        async with session.get(victim.base + "/health") as r:  # still draining
            assert r.status == 503 and (await r.json())["status"] == "draining"
        # Turn 5 during the drain: the victim refuses (503 shutdown), HAProxy resends it to
        # another board, or has already taken the victim out of the pool.
        await asyncio.gather(*(c.step(session, fleet.base) for c in convs))
        # The stream under way at SIGTERM finished where it ran; from SIGTERM on nothing
        # new went to the victim.
        assert moved[0].turns[3].board == victim.name
        assert all(c.turns[4].board != victim.name for c in moved)
        await fleet.wait_status(session, victim.name, "DOWN")
        # Turns 6 and 7 on the remaining boards: the moved conversations settled on a new
        # board and are warm there again; the others never left theirs.
        for _ in range(2):
            await asyncio.gather(*(c.step(session, fleet.base) for c in convs))
        for c in moved:
            assert c.turns[5].board != victim.name
            assert_warm(c.turns[5:])
        for c in stayed:
            assert_warm(c.turns)
        assert await asyncio.to_thread(victim.process.wait, 30) == 0  # drained, then exited
        status = await fleet.server_status(session)
        assert status[victim.name] == "DOWN"
        assert all(status[b.name] == "UP" for b in fleet.boards if b is not victim)
        # The HAProxy log names every request; none of them failed.
        codes = re.findall(r" boards/\S+ \S+ (\d{3}) ", (tmp_path / "haproxy.log").read_text())
        assert codes == ["200"] * len(convs) * 7, codes


async def test_routing_key_fallbacks(tmp_path):
    """prompt_cache_key first, then x-session-affinity, session_id, Authorization: each
    key keeps its board and different keys spread over the boards."""
    async with local_fleet(tmp_path) as fleet, aiohttp.ClientSession() as session:
        messages = [{"role": "user", "content": "Hi."}]

        async def board_for(**kw: Any) -> str:
            return (await chat(session, fleet.base, messages, max_tokens=1, **kw)).board

        keys = [f"k{i}" for i in range(8)]
        kinds = {
            "prompt_cache_key": lambda k: {"key": k},
            "x-session-affinity": lambda k: {"headers": {"x-session-affinity": k}},
            "session_id": lambda k: {"headers": {"session_id": k}},
            "authorization": lambda k: {"headers": {"authorization": f"Bearer {k}"}},
        }
        placed: dict[str, dict[str, str]] = {}
        for kind, how in kinds.items():
            placed[kind] = {k: await board_for(**how(k)) for k in keys}
            again = {k: await board_for(**how(k)) for k in keys}
            assert again == placed[kind], kind
            assert len(set(placed[kind].values())) >= 2, (kind, placed[kind])
        # The same string routes the same way whichever way it came: one hash ring.
        assert placed["prompt_cache_key"] == placed["x-session-affinity"] == placed["session_id"]
        # Precedence: the body key wins over every header, the headers in order.
        a, b = next((a, b) for a in keys for b in keys
                    if placed["prompt_cache_key"][a] != placed["prompt_cache_key"][b])
        every_header = {"x-session-affinity": b, "session_id": b, "authorization": b}
        assert await board_for(key=a, headers=every_header) == placed["prompt_cache_key"][a]
        assert await board_for(headers={"x-session-affinity": a, "session_id": b,
                                        "authorization": b}) == placed["prompt_cache_key"][a]
        assert await board_for(headers={"session_id": a, "authorization": b}) \
            == placed["prompt_cache_key"][a]


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    return float(re.search(rf"(?m)^{name} (\S+)$", text).group(1))


async def wait_metric(session: aiohttp.ClientSession, base: str, name: str,
                      value: float) -> None:
    deadline = time.monotonic() + 30
    while await metric(session, base, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.01)


async def test_a_busy_board_refuses_and_haproxy_sends_the_request_elsewhere(tmp_path):
    """A board whose queue is full answers 503 + Retry-After; through HAProxy the same
    request is resent to another board and answered."""
    async with local_fleet(tmp_path, serve_args=("--max-queue", "1")) as fleet, \
            aiohttp.ClientSession() as session:
        key = "busy"
        board = fleet.board((await chat(session, fleet.base, [{"role": "user", "content": "Hi."}],
                                        key=key, max_tokens=1)).board)
        # Two long prompts no cache holds (seconds of prefill each): one running, one waiting.
        def long(tag: str) -> list[dict]:
            return [{"role": "user",
                     "content": " ".join(f"{tag} city{i} is sunny" for i in range(120))}]

        started = await metric(session, board.base, "ling3_engine_requests_total")
        first = asyncio.create_task(chat(session, fleet.base, long("a"), key=key, max_tokens=1))
        await wait_metric(session, board.base, "ling3_engine_requests_total", started + 1)
        second = asyncio.create_task(chat(session, fleet.base, long("b"), key=key, max_tokens=1))
        await wait_metric(session, board.base, "ling3_queue_depth", 1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1}
        async with session.post(board.base + "/v1/chat/completions", json=body) as r:
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "server_busy"
        third = await chat(session, fleet.base, [{"role": "user", "content": "Hi."}], key=key,
                           max_tokens=1)
        assert third.board != board.name
        assert await metric(session, board.base, "ling3_queue_depth") == 1  # still busy
        assert {(await first).board, (await second).board} == {board.name}

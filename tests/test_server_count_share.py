"""Token counting shares the generation routes' bounds: the engine's bounded encoding
(``Engine.count_prompt``: the context limit, stopped when its caller is cancelled) and at
most its share of the worker threads (``WorkerShare``), so counting never starves
generation. Events and gates, never timing: the share is checked by who holds a thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp
import pytest
from scripted_engine import ScriptedEngine
from server_harness import chat_body, running_server
from test_engine_loop import C, T, make_engine, prompt, until

from ling3_rknn.engine.api import ContextLengthExceeded
from ling3_rknn.server import AppConfig
from ling3_rknn.server.worker_share import WorkerShare, counting_share
from ling3_rknn.tokenizer import EncodingStopped, Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
MODEL = "ling-3.0-tiny"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


# ---- the share --------------------------------------------------------------------------


def test_the_counting_share_is_a_quarter_of_the_pool_and_never_zero():
    assert [counting_share(n) for n in (1, 5, 6, 12, 32)] == [1, 1, 1, 3, 8]
    with pytest.raises(ValueError):
        WorkerShare(0)


async def test_a_share_of_one_runs_one_job_and_keeps_the_slot_until_its_thread_ends():
    share = WorkerShare(1)
    release_a = threading.Event()
    started: list[str] = []

    def job(name: str, gate: threading.Event | None) -> str:
        started.append(name)
        if gate is not None:
            gate.wait(30)
        return name

    a = asyncio.create_task(share.run(job, "a", release_a))
    await until(lambda: started == ["a"])
    b = asyncio.create_task(share.run(job, "b", None))
    await asyncio.sleep(0.05)  # b had every chance to start; it must be waiting
    assert started == ["a"] and share.running == 1
    a.cancel()  # a's client left: its thread still runs, so it keeps the slot
    with pytest.raises(asyncio.CancelledError):
        await a
    await asyncio.sleep(0.05)
    assert started == ["a"] and share.running == 1
    release_a.set()
    assert await b == "b"
    assert started == ["a", "b"]
    await until(lambda: share.running == 0)


# ---- the engine's bounded count ----------------------------------------------------------


async def test_count_prompt_counts_what_generate_admits_and_refuses_past_the_context(tok):
    engine, _ = make_engine(tok, max_context=64)
    with engine:
        assert await engine.count_prompt(prompt()) == len(engine.encode_prompt(prompt()))
        with pytest.raises(ContextLengthExceeded) as cheap:  # the length alone says so
            await engine.count_prompt([T("x" * 64 * tok.max_token_bytes)])
        assert "at least" in str(cheap.value)
        with pytest.raises(ContextLengthExceeded):  # encoded, then too long
            await engine.count_prompt([*prompt(), T(" hello" * 80)])


def test_encoding_stops_between_pieces_when_asked(tok):
    asked: list[bool] = []

    def stop_on_third() -> bool:
        asked.append(True)
        return len(asked) >= 3

    text = "abcd " * 60_000  # several 64K-character pieces
    with pytest.raises(EncodingStopped):
        tok.encode_segments([T(text)], max_tokens=10**9, stop=stop_on_third)
    assert len(asked) == 3
    with pytest.raises(EncodingStopped):  # between runs, too
        tok.encode_segments([T("a"), C("<|role_end|>"), T("b")], stop=lambda: True)
    assert tok.encode_segments([T("a b")], stop=lambda: False) == tok.encode_text("a b")


async def test_a_cancelled_count_stops_its_encoding_thread(tok):
    """The caller leaves while the encoding runs: the thread is told to stop (it would
    otherwise encode for nobody) and ends."""
    engine, _ = make_engine(tok, max_context=64)
    entered, ended, give_up = threading.Event(), threading.Event(), threading.Event()
    seen_stop: list[bool] = []

    def encode(segments, max_tokens=None, stop=None):
        entered.set()
        try:
            while not (stop is not None and stop()) and not give_up.wait(0.01):
                pass
            seen_stop.append(stop is not None and stop())
            raise EncodingStopped
        finally:
            ended.set()

    with engine:
        engine._encoder.encode = encode  # type: ignore[method-assign]
        task = asyncio.create_task(engine.count_prompt(prompt()))
        await until(entered.is_set)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        try:
            await until(ended.is_set, timeout=10)
        finally:
            give_up.set()
    assert seen_stop == [True]


# ---- the route ----------------------------------------------------------------------------


class GatedCounts(ScriptedEngine):
    """Counts that wait on a gate, recording how many run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.now = self.most = 0

    async def count_prompt(self, segments):
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await self.gate.wait()
            return await super().count_prompt(segments)
        finally:
            self.now -= 1


async def test_counts_wait_for_their_share_while_a_chat_is_served():
    engine = GatedCounts()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
    async with (running_server(engine, AppConfig(count_threads=1)) as srv,
                aiohttp.ClientSession() as session):
        async def count() -> int:
            async with session.post(srv.v1 + "/messages/count_tokens", json=body) as r:
                assert r.status == 200
                return (await r.json())["input_tokens"]

        counts = [asyncio.create_task(count()) for _ in range(4)]
        await until(lambda: engine.now == 1)
        async with session.post(srv.v1 + "/chat/completions", json=chat_body()) as r:
            assert r.status == 200  # served while four counts wait
        assert engine.most == 1
        engine.gate.set()
        assert len(set(await asyncio.gather(*counts))) == 1
    assert engine.most == 1 and engine.counted == 4

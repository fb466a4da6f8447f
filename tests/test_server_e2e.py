"""End to end with no test double: the embedded demo bundle (a trained tiny Ling-3.0, its
stage graphs through the RKNNLite mock, int4 QMoE experts) loaded the way ``serve`` loads
it, run by the real engine, served by the real server, driven by the official openai SDK
over HTTP on 127.0.0.1; plus the ``ling3-rknn serve`` process itself (start, health, a
completion, SIGTERM). The demo as an agent: ``test_demo_agent.py``."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import openai
import pytest
from server_harness import running_server

from ling3_rknn.demo import load_demo_engine
from ling3_rknn.loading import LoadOptions

USER = [{"role": "user", "content": "Write a haiku about the NPU."}]


@pytest.fixture
async def client_and_engine():
    engine = load_demo_engine(LoadOptions(model_id="ling-3.0-tiny", max_context=256))
    try:
        async with running_server(engine) as srv:
            client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
            try:
                yield client, engine, srv
            finally:
                await client.close()
    finally:
        await asyncio.to_thread(engine.close)


async def test_real_engine_non_stream_stream_and_prefix_cache(client_and_engine):
    client, engine, _ = client_and_engine
    greedy = {"model": "ling-3.0-tiny", "messages": USER, "max_tokens": 12, "temperature": 0}
    first = await client.chat.completions.create(**greedy)
    second = await client.chat.completions.create(**greedy)
    stream = await client.chat.completions.create(
        **greedy, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]

    choice = first.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert 1 <= first.usage.completion_tokens <= 12
    assert first.usage.prompt_tokens > 10
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The same prompt again restores the snapshot taken at the end of the first prompt.
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert engine.stats().cache_hits >= 1
    # Greedy decoding: the same text whether restored from the cache or streamed.
    whole = first.choices[0].message
    for other in (second.choices[0].message,):
        assert other.content == whole.content
        assert (other.model_extra or {}).get("reasoning_content") == (whole.model_extra or {}).get(
            "reasoning_content"
        )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join(
        (d.model_extra or {}).get("reasoning_content") or "" for d in deltas
    )
    streamed_content = "".join(d.content or "" for d in deltas)
    assert streamed_reasoning == ((whole.model_extra or {}).get("reasoning_content") or "")
    assert streamed_content == (whole.content or "")
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens


async def test_real_engine_context_overflow_is_compaction_signal(client_and_engine):
    client, _, _ = client_and_engine
    long = [{"role": "user", "content": "tool output line\n" * 200}]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="ling-3.0-tiny", messages=long)
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in info.value.message


async def test_real_engine_disconnect_cancels_and_next_request_is_served(client_and_engine):
    """A client that goes away mid-answer cancels its generation, and the next request is
    served. Deterministic on a loaded host: the real model's decode steps wait until the
    server has closed the generation (what the handler does when its client disconnects),
    so the answer is always still running when the client leaves (the demo would otherwise
    finish its ~34-token answer in a fraction of a second, before any disconnect)."""
    client, engine, srv = client_and_engine
    started, closed = threading.Event(), threading.Event()
    generate, forward = engine.generate, engine.model.forward

    async def watched_generate(request):
        inner = generate(request)
        try:
            async for event in inner:
                yield event
        finally:
            await inner.aclose()  # as the handler's close reaches the engine: cancel is set
            closed.set()

    def gated_forward(ids, state, **kwargs):
        if len(ids) == 1:  # decode steps wait for the disconnect (bounded)
            started.set()
            closed.wait(60)
        return forward(ids, state, **kwargs)

    engine.generate, engine.model.forward = watched_generate, gated_forward
    payload = {
        "model": "ling-3.0-tiny",
        "messages": USER,
        "max_tokens": 200,
        "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(srv.v1 + "/chat/completions", json=payload) as response,
        ):
            assert response.status == 200
            await response.content.readline()  # the role chunk: the request is admitted
            # the worker has prefilled and sampled: the answer is running when we leave
            assert await asyncio.to_thread(started.wait, 60), "the answer never started"
        assert await asyncio.to_thread(closed.wait, 60), "the server never closed the stream"
        deadline = time.monotonic() + 60  # generous: a loaded 2-core host delays the worker
        while engine.stats().cancelled < 1:
            assert time.monotonic() < deadline, "generation was not cancelled"
            await asyncio.sleep(0.02)
    finally:
        closed.set()
        engine.generate, engine.model.forward = generate, forward
    assert engine.stats().completion_tokens < 200
    after = await client.chat.completions.create(
        model="ling-3.0-tiny", messages=USER, max_tokens=3, temperature=0
    )
    assert after.usage.completion_tokens >= 1


def _start_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LING3_RKNN_API_KEY", None)
    return subprocess.Popen(
        [sys.executable, "-m", "ling3_rknn.cli", "serve", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _wait_for_port(process: subprocess.Popen) -> int:
    assert process.stderr is not None
    for line in process.stderr:
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if found:
            return int(found.group(1))
    raise AssertionError(f"server exited with {process.wait()} before listening")


async def _wait_until_ready(session: aiohttp.ClientSession, base: str) -> None:
    """/health answers 503 while the model loads, then 200."""
    for _ in range(3000):
        async with session.get(base + "/health") as r:
            if r.status == 200:
                return
            assert r.status == 503
        await asyncio.sleep(0.02)
    raise AssertionError("the model did not become ready")


async def test_cli_serve_default_model_health_completion_and_sigterm():
    """`ling3-rknn serve` with no model flag: the embedded demo bundle (= `make serve`);
    after SIGTERM it drains (/health 503 for --drain-seconds), then exits 0."""
    process = _start_cli("--port", "0", "--api-key", "k", "--drain-seconds", "3")
    try:
        port = await asyncio.to_thread(_wait_for_port, process)
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await _wait_until_ready(session, base)
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        try:
            (model,) = (await client.models.list()).data
            done = await client.chat.completions.create(model=model.id, messages=USER, max_tokens=4)
            assert done.usage.completion_tokens >= 1
        finally:
            await client.close()
        process.send_signal(signal.SIGTERM)
        async with aiohttp.ClientSession() as session:
            for _ in range(500):  # the signal is handled within a loop turn
                async with session.get(base + "/health") as r:
                    if r.status == 503:
                        assert (await r.json())["status"] == "draining"
                        break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("/health never said draining")
        assert await asyncio.to_thread(process.wait, 20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_exits_non_zero_when_the_model_cannot_load(tmp_path):
    process = _start_cli("--hf", str(tmp_path / "missing"), "--port", "0")
    try:
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert "model failed to load" in err


async def test_cli_prefix_cache_survives_a_restart(tmp_path):
    """SIGTERM flushes the prefix cache to --cache-dir; the restarted service answers the
    same agent prompt from it instead of evaluating it again."""
    payload = {
        "model": "ling-3.0-tiny-demo",
        "messages": [
            {"role": "system", "content": "You are a careful coding agent. " * 20},
            {"role": "user", "content": "List the files."},
        ],
        "max_tokens": 2,
    }
    cached = []
    for _ in range(2):
        process = _start_cli("--demo", "--port", "0", "--cache-dir", str(tmp_path / "cache"))
        try:
            port = await asyncio.to_thread(_wait_for_port, process)
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                await _wait_until_ready(session, base)
                async with session.post(base + "/v1/chat/completions", json=payload) as r:
                    assert r.status == 200
                    usage = (await r.json())["usage"]
            cached.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.wait, 20) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    (prompt_tokens, cold), (_, warm) = cached
    assert cold == 0
    assert warm > prompt_tokens // 2


async def test_cli_tells_systemd_when_ready_and_when_stopping(tmp_path):
    """A ``Type=notify`` unit: READY=1 arrives only once /health answers 200 (the model
    loaded), STOPPING=1 when SIGTERM starts the drain."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(60)
    os.environ["NOTIFY_SOCKET"] = str(path)
    try:
        process = _start_cli("--port", "0")
    finally:
        del os.environ["NOTIFY_SOCKET"]
    try:
        port = await asyncio.to_thread(_wait_for_port, process)
        assert await asyncio.to_thread(sock.recv, 64) == b"READY=1"
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/health") as r,
        ):
            assert r.status == 200
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(sock.recv, 64) == b"STOPPING=1"
        assert await asyncio.to_thread(process.wait, 20) == 0
    finally:
        sock.close()
        if process.poll() is None:
            process.kill()
            process.wait()

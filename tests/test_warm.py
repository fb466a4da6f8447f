"""``ling3-rknn warm``: recorded requests replayed into a running server's prefix cache, which
``--cache-dir`` keeps across a restart, so an agent's first real session after an install is
a cache hit; and the replayer's own input checks."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import aiohttp
import pytest
from test_server_e2e import _start_cli, _wait_for_port, _wait_until_ready

from ling3_rknn.warm import WarmError, load_requests, replay_body

SYSTEM = ("You are a coding agent working in a git repository. Read files before editing "
          "them, keep the project's style, and run the tests after every change. " * 12)
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def _agent_request(question: str, **extra) -> dict:
    return {"model": "ling-3.0-tiny-demo", "tools": TOOLS, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], **extra}


async def test_warmed_prompt_serves_the_next_session_after_a_restart(tmp_path):
    recorded = tmp_path / "opencode-first.json"
    recorded.write_text(json.dumps(_agent_request("Fix the failing test.", max_tokens=4096)))
    cache = str(tmp_path / "cache")
    process = _start_cli("--demo", "--port", "0", "--cache-dir", cache)
    try:
        port = await asyncio.to_thread(_wait_for_port, process)
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await _wait_until_ready(session, base)
        warm = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "ling3_rknn.cli", "warm", "--url", base, str(recorded)],
            capture_output=True, text=True, timeout=300)
        assert warm.returncode == 0, warm.stdout + warm.stderr
        assert "0 already cached" in warm.stdout
        process.send_signal(signal.SIGTERM)  # flushes the cache to --cache-dir
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    process = _start_cli("--demo", "--port", "0", "--cache-dir", cache)
    try:
        port = await asyncio.to_thread(_wait_for_port, process)
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await _wait_until_ready(session, base)
            # the agent's first real session: same system prompt and tools, its own question
            body = _agent_request("Add a test for empty input.", stream=False, max_tokens=2)
            async with session.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0.8 * usage["prompt_tokens"]  # all of the system prompt and tools


def test_replayed_body_asks_for_one_token_and_no_stream():
    body = _agent_request("hi", max_completion_tokens=900, stream_options={"x": 1}, n=1,
                          temperature=0.2)
    out = replay_body(body, None)
    assert out["max_tokens"] == 1 and "stream" not in out and "stream_options" not in out
    assert "max_completion_tokens" not in out and "n" not in out
    assert out["messages"] == body["messages"] and out["tools"] == TOOLS  # the prefix as sent
    assert out["temperature"] == 0.2
    assert replay_body(body, "other")["model"] == "other"


def test_files_hold_one_object_or_jsonl(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_agent_request("a"), indent=2))
    many = tmp_path / "many.jsonl"
    many.write_text("\n".join(json.dumps(_agent_request(q)) for q in ("a", "b")) + "\n")
    got = load_requests([one, many])
    assert [label for label, _ in got] == [str(one), f"{many}:1", f"{many}:2"]


@pytest.mark.parametrize("content,message", [
    ("{not json", "not JSON or JSONL"),
    ('{"model": "x"}', "no messages list"),
    ("[1, 2]", "no messages list"),
    ("", "no requests"),
])
def test_bad_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(WarmError, match=message):
        load_requests([path])


def test_cli_without_a_server_says_so_and_exits_2(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_agent_request("a")))
    done = subprocess.run([sys.executable, "-m", "ling3_rknn.cli", "warm", "--url",
                           "http://127.0.0.1:9", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "no answer from" in done.stdout


async def test_warm_reports_the_prompt_and_cached_tokens_the_server_answered():
    """The counts come from the answer's usage (cached tokens from its
    prompt_tokens_details), never a default that reads 0."""
    from scripted_engine import ScriptedEngine
    from server_harness import running_server

    from ling3_rknn.warm import warm

    engine = ScriptedEngine()
    engine.push("</think>ok", cached_tokens=7)
    async with running_server(engine) as srv:
        (done,) = await asyncio.to_thread(
            warm, srv.base, [("a.json", _agent_request("hi"))], model="ling-3.0-tiny")
    assert done.source == "a.json"
    assert done.cached_tokens == 7
    assert done.prompt_tokens > 7

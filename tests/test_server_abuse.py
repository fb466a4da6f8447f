"""One careless client must not take the board down: black-box attacks over HTTP on the real
server and engine (the demo bundle), each while another client measures ``/health``.

Bounds are generous (seconds: the test host is shared and loaded); the attacks they guard
against stalled every other client for 7 to 80 seconds before their fixes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from server_harness import running_server

from ling3_rknn.demo import load_demo_engine
from ling3_rknn.loading import LoadOptions
from ling3_rknn.server import AppConfig

MODEL = "ling-3.0-tiny"
# Another client's /health must answer within this while an attack runs (seconds: a loaded
# 2-core host; the attacks stalled it for 7 s and more).
HEALTH_BOUND_S = 2.5


def rss_mb() -> float:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class HealthWatch:
    """Polls /health from its own client while the block runs; ``worst`` is the slowest
    answer seen (a stalled event loop shows here)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.worst = 0.0
        self.answers = 0

    async def _poll(self, stop: asyncio.Event) -> None:
        # Latency from when the client meant to ask (every 50 ms): a stall that begins while
        # it waits between requests counts too (the server shares this process).
        async with aiohttp.ClientSession() as session:
            due = time.monotonic()
            while not stop.is_set():
                async with session.get(self.base + "/health") as r:
                    assert r.status == 200
                done = time.monotonic()
                self.worst = max(self.worst, done - due)
                self.answers += 1
                due = done + 0.05
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def health_watch(base: str) -> AsyncIterator[HealthWatch]:
    watch = HealthWatch(base)
    stop = asyncio.Event()
    task = asyncio.create_task(watch._poll(stop))
    await asyncio.sleep(0.1)
    try:
        yield watch
    finally:
        stop.set()
        await task
    assert watch.answers >= 1


@pytest.fixture(scope="module")
def demo_engine():
    engine = load_demo_engine(LoadOptions(model_id=MODEL, max_context=4096))
    yield engine
    engine.close()


async def post(session: aiohttp.ClientSession, url: str, payload: object) -> tuple[int, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload)
    async with session.post(url, data=data,
                            headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


# ---- 1: an oversize prompt ------------------------------------------------------------------


async def test_oversize_prompt_is_refused_without_stalling_other_clients(demo_engine):
    """6 MB of prompt (under the body limit): a 400 context_length_exceeded, while another
    client's /health keeps answering and the memory stays bounded. Before the fix the prompt
    was encoded whole holding the GIL (seconds of stall, gigabytes of ids)."""
    prompt = "abcd " * 1_200_000
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    before = rss_mb()
    async with (running_server(demo_engine) as srv, health_watch(srv.base) as watch,
                aiohttp.ClientSession() as session):
        results = await asyncio.gather(*(post(session, srv.v1 + "/chat/completions", body)
                                         for _ in range(2)))
    for status, answer in results:
        assert status == 400
        assert answer["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 4096 tokens" in answer["error"]["message"]
    assert watch.worst < HEALTH_BOUND_S, f"/health took {watch.worst:.1f} s during the attack"
    grown = rss_mb() - before
    assert grown < 300, f"RSS grew by {grown:.0f} MB"


async def test_a_long_prompt_under_the_cheap_bound_stops_encoding_early(demo_engine):
    """Past the length bound but still over the context: refused after a few pieces, and a
    prompt that fits is still served with exactly the whole-string ids."""
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        longest = demo_engine._tokenizer.max_token_bytes
        # Just under the cheap bound: only piecewise counting can refuse it.
        text = ("abcd " * (4096 * longest // 5))[: 4096 * longest - 200]
        status, answer = await post(session, srv.v1 + "/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        assert "at least" in answer["error"]["message"]


# ---- 1b: counting tokens is bounded like generating -----------------------------------------

COUNT_PATH = "/messages/count_tokens"
TOO_LONG = re.compile(r"prompt is too long: \d+ tokens > 4096 maximum")


async def test_count_tokens_refuses_an_oversize_prompt_like_generation(demo_engine):
    """count_tokens on 6 MB of prompt: the generation routes' 400 (in the Messages shape,
    the wording Claude Code compacts on), before encoding, while /health keeps answering
    and memory stays bounded. Before, it encoded the whole prompt: 200 with 12 M tokens
    after 14 s, RSS +3 GB that stayed."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "abcd " * 1_200_000}]}
    before = rss_mb()
    async with (running_server(demo_engine) as srv, health_watch(srv.base) as watch,
                aiohttp.ClientSession() as session):
        results = await asyncio.gather(*(post(session, srv.v1 + COUNT_PATH, body)
                                         for _ in range(2)))
    for status, answer in results:
        assert status == 400, answer
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "invalid_request_error"
        assert TOO_LONG.fullmatch(answer["error"]["message"]), answer
    assert watch.worst < HEALTH_BOUND_S, f"/health took {watch.worst:.1f} s during the attack"
    grown = rss_mb() - before
    assert grown < 300, f"RSS grew by {grown:.0f} MB"


async def test_count_tokens_under_the_cheap_bound_stops_early_and_counts_what_fits(
        demo_engine):
    """Under the length bound but over the context: refused by the piecewise count (as the
    generation routes are); a prompt that fits is counted exactly as generation admits it."""
    longest = demo_engine._tokenizer.max_token_bytes
    text = ("abcd " * (4096 * longest // 5))[: 4096 * longest - 200]
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        status, answer = await post(session, srv.v1 + COUNT_PATH, {
            "model": MODEL, "messages": [{"role": "user", "content": text}]})
        assert status == 400 and TOO_LONG.fullmatch(answer["error"]["message"]), answer
        fits = {"model": MODEL, "messages": [{"role": "user", "content": "abcd " * 300}]}
        status, counted = await post(session, srv.v1 + COUNT_PATH, fits)
        assert status == 200, counted
        status, done = await post(session, srv.v1 + "/messages", {**fits, "max_tokens": 1})
        assert status == 200, done
        usage = done["usage"]
        assert counted["input_tokens"] == (usage["input_tokens"]
                                           + usage["cache_read_input_tokens"])


async def test_count_tokens_refuses_a_flood_of_image_blocks_before_they_become_tokens(
        demo_engine):
    """100k image blocks in one tool_result (3.3 MB of JSON, 2.3 M tokens of notes before):
    a 400 naming the field, before any block is read."""
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": ""}}] * 100_000
    body = {"model": MODEL, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": blocks}]}]}
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        for path in (COUNT_PATH, "/messages"):
            status, answer = await post(session, srv.v1 + path, {**body, "max_tokens": 1}
                                        if path == "/messages" else body)
            assert status == 400, answer
            assert answer["error"]["message"].startswith("messages[2].content[0].content:"), \
                answer


# ---- 2: an exponential regex ----------------------------------------------------------------


def _regex_tool(value: str, pattern: str) -> list[dict]:
    return [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": ["x"], "properties": {
            "x": {"type": "string", "enum": [value], "pattern": pattern}}}}}]


@pytest.mark.parametrize(("value", "pattern", "choice"), [
    # Python's re: ~8 s at 28 characters, doubling per character.
    ("a" * 28 + "!", "^(a+)+$", {"tool_choice": "required"}),
    # Also slow for the regex package: its timeout ends it.
    ("a" * 38 + "!", "^(a|aa)+$", {"tool_choice": "required"}),
    ("a" * 28 + "!", "^(a+)+$", {"parallel_tool_calls": False}),
])
async def test_a_catastrophic_pattern_against_an_enum_does_not_stall_the_server(
        demo_engine, value, pattern, choice):
    """The enum-vs-pattern check runs with a bounded matcher off the event loop: a forced
    call is a 400 naming the parameter, a lenient tool of an auto turn gets free arguments,
    and another client's /health answers meanwhile."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": _regex_tool(value, pattern), **choice}
    before = rss_mb()
    async with (running_server(demo_engine) as srv, health_watch(srv.base) as watch,
                aiohttp.ClientSession() as session):
        status, answer = await post(session, srv.v1 + "/chat/completions", body)
    if "tool_choice" in choice:
        assert status == 400, answer
        assert answer["error"]["param"] == "tools[0].function.parameters.properties.x"
    else:
        assert status == 200, answer
    assert watch.worst < HEALTH_BOUND_S, f"/health took {watch.worst:.1f} s during the attack"
    assert rss_mb() - before < 200


# ---- 3: connections that never finish their headers ---------------------------------------


async def _eof_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not
    close it within ``seconds``)."""
    return await asyncio.wait_for(reader.read(), seconds)


async def test_silent_connections_are_capped_and_closed_with_one_log_line(demo_engine, caplog):
    """60 connections that send half a request's headers and stop, against a cap of 40:
    the ones past the cap get a 503 at once, the others are closed at the header deadline,
    a body that never arrives is a 408, another client's /health keeps answering, and each
    condition is one log line without a traceback."""
    config = AppConfig(max_connections=40, header_timeout_s=1.0, body_timeout_s=1.0,
                       keepalive_timeout_s=1.0)
    before = rss_mb()
    caplog.set_level("INFO")
    async with running_server(demo_engine, config) as srv, health_watch(srv.base) as watch:
        port = int(srv.base.rsplit(":", 1)[1])
        streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(60)]
        for _, writer in streams:
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        answers = await asyncio.gather(*(_eof_within(r, 15) for r, _ in streams))
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) >= 60 - 40 + 1  # the health watch holds one slot too
        assert all(b"Retry-After: 1" in a for a in refused)
        assert all(a == b"" for a in answers if a not in refused)  # closed, no answer
        # A body announced and never sent: 408 once the body deadline passes.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        answer = await _eof_within(reader, 15)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        # One whole request, then half of the next one's headers: the keep-alive deadline.
        again, writer2 = await asyncio.open_connection("127.0.0.1", port)
        writer2.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert (await again.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer2.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        assert b"HTTP/1.1" not in await _eof_within(again, 15)
        for _, w in [*streams, (reader, writer), (again, writer2)]:
            w.close()
        async with aiohttp.ClientSession() as session, session.get(srv.v1 + "/models") as r:
            assert r.status == 200  # new clients are served again
    assert watch.worst < HEALTH_BOUND_S, f"/health took {watch.worst:.1f} s during the attack"
    assert rss_mb() - before < 200
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("no complete request headers" in m for m in messages) == 1, messages
    assert sum("refusing connections" in m for m in messages) == 1, messages
    assert not any(r.exc_info for r in caplog.records)


def test_the_connection_cap_stays_below_the_descriptor_limit():
    import resource

    from ling3_rknn.server.connections import FD_RESERVE, default_max_connections

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = default_max_connections()
    assert cap <= max(16, soft - FD_RESERVE) and cap < soft


# ---- 4: forced text that spells a marker ----------------------------------------------------

# Closed objects (additionalProperties false): the forced text is the whole answer, so the
# test does not depend on how long the demo model would go on adding properties.
_MARKER_SCHEMAS = [
    # response_format: a const string that spells two markers
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"a": {"const": "<role>admin</role>"}},
        "required": ["a"], "additionalProperties": False}}}}, {"a": "<role>admin</role>"}),
    # a property key that spells the end-of-turn marker
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"<|role_end|>": {"const": 1}},
        "required": ["<|role_end|>"], "additionalProperties": False}}}},
     {"<|role_end|>": 1}),
    # a JSON-typed argument of a required tool whose const spells <think>
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": ["o"], "properties": {
            "o": {"type": "object", "properties": {"t": {"const": "<think>"}},
                  "required": ["t"], "additionalProperties": False}}}}}]},
     {"o": {"t": "<think>"}}),
]


@pytest.mark.parametrize(("extra", "expected"), _MARKER_SCHEMAS)
async def test_forced_text_that_spells_a_marker_is_generated_as_text(demo_engine, extra,
                                                                     expected):
    """What the grammar forces is tokenized as text, never into a special id the grammar
    then rejects: the answer is the forced JSON, not a 400 after the reasoning."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 200, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}, **extra}
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        status, answer = await post(session, srv.v1 + "/chat/completions", body)
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    if "tools" in extra:
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == expected
    else:
        assert json.loads(message["content"]) == expected, answer


# ---- 5: no 500 from client input ------------------------------------------------------------


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"n": schema}}
    return schema


def _tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required or []}}}


_DEEP_ARGUMENTS = "[" * 5000 + "]" * 5000
_CLIENT_ERRORS = [
    # a tool parameter nested ~600 deep (RecursionError in the schema rewrite), forced...
    ({"tools": [_tool("f", {"x": _nested_schema(300)}, ["x"])], "tool_choice": "required"},
     "tools[0].function.parameters.properties.x"),
    # ...and on a lenient tool of an auto turn
    ({"tools": [_tool("get_weather", {"city": {"type": "string"}}),
                _tool("other", {"x": _nested_schema(300)})], "parallel_tool_calls": False},
     "tools[1].function.parameters.properties.x"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "x-guidance": "fast"}}}},
     "response_format.json_schema.schema.x-guidance"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "x-guidance": ["a"]}}}},
     "response_format.json_schema.schema.x-guidance"),
    ({"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": _DEEP_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
      "tools": [_tool("f", {})]},
     "messages"),
    ({"seed": -1}, "seed"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
]


async def _metric(session: aiohttp.ClientSession, base: str, name: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


@pytest.mark.parametrize(("extra", "param"), _CLIENT_ERRORS)
async def test_client_input_is_a_400_naming_the_field_never_a_500(demo_engine, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **extra}
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        npu_before = await _metric(session, srv.base, "ling3_npu_errors")
        status, answer = await post(session, srv.v1 + "/chat/completions", body)
        assert status == 400, answer
        error = answer["error"]
        assert (error["param"] or "").startswith(param), error
        if param == "messages":
            assert "messages[1].tool_calls[0].function.arguments" in error["message"]
        # Counted as the client's error, not the device's; the model state is untouched.
        errors = await _metric(session, srv.base, "ling3_request_errors_total")
        assert errors.get('ling3_request_errors_total{kind="client"}') == 1.0, errors
        assert 'ling3_request_errors_total{kind="device"}' not in errors
        assert await _metric(session, srv.base, "ling3_npu_errors") == npu_before
        status, _ = await post(session, srv.v1 + "/chat/completions",
                               {"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200


# ---- 6: lenient tools whose error names no grammar line ------------------------------------


async def test_a_lenient_tool_the_library_refuses_without_a_line_still_serves(demo_engine):
    """A pattern past llguidance's lexer limits fails the compile with no grammar line; the
    other tool of an auto turn stays callable and the request is served (docs/serving.md 9),
    as it is without parallel_tool_calls: false."""
    weather = _tool("get_weather", {"city": {"type": "string"}}, ["city"])
    other = _tool("other", {"x": {"type": "string", "pattern": "^a{100000}$"}}, ["x"])
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        for extra in ({}, {"parallel_tool_calls": False}):
            status, answer = await post(session, srv.v1 + "/chat/completions", {
                "model": MODEL, "max_tokens": 8, "tools": [weather, other], **extra,
                "messages": [{"role": "user", "content": "What is the weather in Lisbon?"}]})
            assert status == 200, (extra, answer)


# ---- 7: SIGTERM with keep-alive connections open -------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP response with a Content-Length body (what the server sends here)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))
    return head + await reader.readexactly(length)


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
async def test_sigterm_answers_requests_on_open_keep_alive_connections(delay_s):
    """`serve` with the default --drain-seconds 0: requests sent on already-open keep-alive
    connections just after SIGTERM get a 503 with Retry-After or a closed connection at
    once, never silence, and the process exits promptly."""
    from test_server_e2e import _start_cli, _wait_for_port, _wait_until_ready

    process = _start_cli("--port", "0")
    try:
        port = await asyncio.to_thread(_wait_for_port, process)
        async with aiohttp.ClientSession() as session:
            await _wait_until_ready(session, f"http://127.0.0.1:{port}")
        connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        body = json.dumps({"model": "ling-3.0-tiny-demo", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        for reader, writer in connections:  # each one used once: an idle keep-alive
            writer.write(request)
            assert (await _read_response(reader)).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(delay_s)
        for _, writer in connections:
            writer.write(request)
        for reader, _ in connections:
            try:
                answer = await asyncio.wait_for(reader.read(), 5)
            except ConnectionResetError:
                answer = b""
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503"), answer[:100]
            if answer:
                assert b"Retry-After:" in answer
        assert await asyncio.to_thread(process.wait, 10) == 0
        assert time.monotonic() - started < 5, "shutdown waited on idle connections"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# ---- 8: Host and Origin on a keyless server ------------------------------------------------


async def _raw_post(port: int, headers: dict[str, str], body: bytes) -> bytes:
    """A POST with exactly these headers (a browser's, or DNS rebinding's Host)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n"
                 "Connection: close\r\n\r\n".encode() + body)
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    return answer


@pytest.mark.parametrize(("headers", "allowed", "status"), [
    # a web page's simple (no preflight) cross-origin POST, after DNS rebinding
    ({"Host": "evil.example", "Origin": "http://evil.example"}, {}, 403),
    ({"Host": "evil.example"}, {}, 403),
    ({"Host": "127.0.0.1", "Origin": "http://evil.example"}, {}, 403),
    ({"Host": "127.0.0.1", "Origin": "null"}, {}, 403),
    # local clients: SDKs and curl send no Origin; a local web UI sends a loopback one
    ({"Host": "127.0.0.1:8080"}, {}, 200),
    ({"Host": "localhost:8080", "Origin": "http://localhost:3000"}, {}, 200),
    ({"Host": "[::1]:8080"}, {}, 200),
    # the allow-lists
    ({"Host": "board.lan:8080", "Origin": "http://ui.lan"},
     {"allowed_hosts": ("board.lan",), "allowed_origins": ("http://ui.lan",)}, 200),
    ({"Host": "127.0.0.1", "Origin": "http://anything.example"},
     {"allowed_origins": ("*",)}, 200),
])
async def test_a_keyless_server_refuses_foreign_host_and_origin(demo_engine, headers, allowed,
                                                                status):
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    async with running_server(demo_engine, AppConfig(**allowed)) as srv:
        port = int(srv.base.rsplit(":", 1)[1])
        answer = await _raw_post(port, {**headers, "Content-Type": "text/plain"}, body)
    assert answer.startswith(f"HTTP/1.1 {status}".encode()), answer[:200]
    if status == 403:
        assert b'"code": "forbidden_' in answer


async def test_a_keyed_server_leaves_host_and_origin_to_the_key(demo_engine):
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    async with running_server(demo_engine, AppConfig(api_key="k")) as srv:
        port = int(srv.base.rsplit(":", 1)[1])
        answer = await _raw_post(port, {"Host": "board.lan", "Origin": "http://ui.lan",
                                        "Authorization": "Bearer k"}, body)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# ---- 9: an empty API key ---------------------------------------------------------------------


def test_an_empty_api_key_is_refused_and_help_prefers_the_variable():
    """`serve --api-key ''` would let an empty Bearer token through: refused at start (exit
    2, before loading anything); --help says to prefer the environment variable."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LING3_RKNN_API_KEY"}
    for key in ("", "   "):
        done = subprocess.run([sys.executable, "-m", "ling3_rknn.cli", "serve", "--port", "0",
                               "--api-key", key], capture_output=True, text=True, timeout=60,
                              env=env)
        assert done.returncode == 2, done.stderr
        assert "--api-key is empty" in done.stderr
    shown = subprocess.run([sys.executable, "-m", "ling3_rknn.cli", "serve", "--help"],
                           capture_output=True, text=True, timeout=60, env=env).stdout
    assert "Prefer the variable" in " ".join(shown.split())
    with pytest.raises(ValueError):
        from ling3_rknn.server import EngineHolder, create_app

        create_app(EngineHolder(), AppConfig(api_key=""))


# ---- 10: the compiled-grammar cache in bytes ------------------------------------------------


async def test_compiled_grammars_are_bounded_in_bytes_and_reported():
    """Distinct large response schemas, one after another: the compiled grammars kept stay
    within the engine's grammar budget, and /metrics reports what they hold."""
    budget = 4 << 20
    engine = load_demo_engine(
        LoadOptions(model_id=MODEL, max_context=4096, grammar_cache_bytes=budget))
    try:
        before = rss_mb()
        async with running_server(engine) as srv, aiohttp.ClientSession() as session:
            for i in range(6):
                schema = {"type": "object", "additionalProperties": False, "properties": {
                    f"p{i}_{j}": {"type": "integer"} for j in range(400)}}
                status, answer = await post(session, srv.v1 + "/chat/completions", {
                    "model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}],
                    "chat_template_kwargs": {"enable_thinking": False},
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "r", "schema": schema}}})
                assert status == 200, answer
            held = await _metric(session, srv.base, "ling3_grammar_cache_bytes")
            entries = await _metric(session, srv.base, "ling3_grammar_cache_entries")
        assert 0 < held["ling3_grammar_cache_bytes"] <= budget
        assert 1 <= entries["ling3_grammar_cache_entries"] < 6
        assert rss_mb() - before < 300
    finally:
        engine.close()

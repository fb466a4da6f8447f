"""Raw-HTTP tests of the running server: every error path, the strict key check, the SSE
chunk rules of docs/serving.md 6.5, disconnects, keep-alive, metrics and shutdown.

The engine is the scripted double (``scripted_engine.py``); rendering and parsing are the
real ``ling3_rknn.chat`` code.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scripted_engine import ScriptedEngine
from server_harness import chat_body, parse_sse, running_server

from ling3_rknn.chat.events import Admitted
from ling3_rknn.engine.api import ContextLengthExceeded
from ling3_rknn.server import AppConfig
from ling3_rknn.server.state import STATE


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


async def post(session: aiohttp.ClientSession, url: str, payload, **kwargs):
    data = payload if isinstance(payload, bytes | str) else json.dumps(payload)
    async with session.post(url, data=data, **kwargs) as response:
        return response.status, response.headers.copy(), await response.text()


def error_of(text: str) -> dict:
    body = json.loads(text)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---- success shapes ----------------------------------------------------------------------


async def test_non_stream_shape_and_usage(engine):
    engine.push("</think>Hel", "lo", cached_tokens=3)
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(s, srv.v1 + "/chat/completions", chat_body())
    assert status == 200
    assert headers["X-Request-Id"]
    body = json.loads(text)
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body["model"] == "ling-3.0-tiny"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    usage = body["usage"]
    assert usage["completion_tokens"] == 2
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_stream_chunk_rules(engine):
    engine.push("</think>Hel", "lo", " there", cached_tokens=2)
    payload = chat_body(stream=True, stream_options={"include_usage": True})
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(s, srv.v1 + "/chat/completions", payload)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events, _ = parse_sse(text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    for chunk in middle:
        delta = chunk["choices"][0]["delta"]
        assert "role" not in delta
        assert delta.get("content") != "" and delta.get("reasoning_content") != ""
        assert chunk["choices"][0]["finish_reason"] is None
        assert chunk["usage"] is None
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in middle) == "Hello there"
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


async def test_stream_without_include_usage_has_no_usage(engine):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        _, _, text = await post(s, srv.v1 + "/chat/completions", chat_body(stream=True))
    events, _ = parse_sse(text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in chunk for chunk in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_route_without_v1_prefix_and_request_id_echo(engine):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, _ = await post(
            s, srv.base + "/chat/completions", chat_body(), headers={"X-Request-Id": "abc-123"}
        )
    assert status == 200
    assert headers["X-Request-Id"] == "abc-123"


async def test_request_reaches_engine_with_sampling_stops_and_thinking(engine):
    payload = chat_body(
        temperature=0.3,
        top_p=0.9,
        seed=11,
        max_tokens=17,
        stop="STOP",
        chat_template_kwargs={"enable_thinking": False},
    )
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, _ = await post(s, srv.v1 + "/chat/completions", payload)
    assert status == 200
    (request,) = engine.requests
    assert request.max_tokens == 17
    assert request.sampling.temperature == 0.3 and request.sampling.seed == 11
    assert set(request.stop) == {"STOP", "<|role_end|>"}
    prompt = "".join(segment.text for segment in request.prompt)
    assert prompt.endswith("<role>ASSISTANT</role>\n<think></think>")
    assert "<role>HUMAN</role>hi<|role_end|>" in prompt


async def test_models_and_health(engine):
    config = AppConfig(model_aliases=("gpt-4o",))
    async with running_server(engine, config) as srv, aiohttp.ClientSession() as s:
        async with s.get(srv.v1 + "/models") as r:
            models = await r.json()
        async with s.get(srv.v1 + "/models/gpt-4o") as r:
            one = await r.json()
        async with s.get(srv.v1 + "/models/nope") as r:
            missing = r.status, error_of(await r.text())
        async with s.get(srv.base + "/health") as r:
            health = r.status, await r.json()
        status, _, _ = await post(
            s, srv.v1 + "/chat/completions", {**chat_body(), "model": "gpt-4o"}
        )
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["ling-3.0-tiny", "gpt-4o"]
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == engine.max_context
    assert one["id"] == "gpt-4o"
    assert missing[0] == 404 and missing[1]["code"] == "model_not_found"
    assert health == (200, {"status": "ok", "model": "ling-3.0-tiny"})
    assert status == 200


# ---- error paths -------------------------------------------------------------------------


async def test_health_is_503_while_loading_then_200():
    release = threading.Event()
    engine = ScriptedEngine()

    def slow_loader():
        release.wait(10)
        return engine

    async with running_server(loader=slow_loader) as srv, aiohttp.ClientSession() as s:
        async with s.get(srv.base + "/health") as r:
            assert r.status == 503
            assert (await r.json())["status"] == "loading"
        status, headers, text = await post(s, srv.v1 + "/chat/completions", chat_body())
        assert status == 503
        assert error_of(text)["code"] == "model_loading"
        assert headers["Retry-After"]
        async with s.get(srv.v1 + "/models") as r:
            assert r.status == 503
        release.set()
        for _ in range(200):
            async with s.get(srv.base + "/health") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.02)
        assert r.status == 200
        status, _, _ = await post(s, srv.v1 + "/chat/completions", chat_body())
        assert status == 200


async def test_health_reports_a_failed_load():
    def broken_loader():
        raise FileNotFoundError("bundle/manifest.json")

    async with running_server(loader=broken_loader) as srv, aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(srv.base + "/health") as r:
                body = await r.json()
            if body["status"] != "loading":
                break
            await asyncio.sleep(0.02)
    assert r.status == 503
    assert body["status"] == "error"
    assert body["error"] == "FileNotFoundError"  # no paths on the unauthenticated probe


async def test_api_key(engine):
    config = AppConfig(api_key="s3cret")
    async with running_server(engine, config) as srv, aiohttp.ClientSession() as s:
        url = srv.v1 + "/chat/completions"
        missing = await post(s, url, chat_body())
        wrong = await post(s, url, chat_body(), headers={"Authorization": "Bearer nope"})
        basic = await post(s, url, chat_body(), headers={"Authorization": "Basic s3cret"})
        good = await post(s, url, chat_body(), headers={"Authorization": "Bearer s3cret"})
        async with s.get(srv.v1 + "/models") as r:
            models_status = r.status
        async with s.get(srv.base + "/metrics") as r:
            metrics_status = r.status
        async with s.get(srv.base + "/health") as r:
            health_status = r.status
    for status, headers, text in (missing, wrong, basic):
        assert status == 401
        assert headers["WWW-Authenticate"] == "Bearer"
        error = error_of(text)
        assert error["type"] == "authentication_error"
        assert "s3cret" not in text
    assert good[0] == 200
    assert models_status == 401 and metrics_status == 401
    assert health_status == 200  # probes need no key
    assert engine.started == 1


async def test_unknown_route_and_method(engine):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        async with s.get(srv.v1 + "/nope") as r:
            not_found = r.status, await r.text()
        async with s.get(srv.v1 + "/chat/completions") as r:
            wrong_method = r.status, await r.text()
    assert not_found[0] == 404
    assert error_of(not_found[1])["code"] == "unknown_route"
    assert wrong_method[0] == 405
    assert error_of(wrong_method[1])["code"] == "method_not_allowed"


async def test_unknown_model_is_404(engine):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", {**chat_body(), "model": "x"})
    assert status == 404
    error = error_of(text)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert engine.requests == []


async def test_body_too_large_is_413(engine):
    config = AppConfig(max_body_bytes=2048)
    async with running_server(engine, config) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", chat_body("x" * 4096))
    assert status == 413
    assert error_of(text)["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "not valid JSON"),
    ],
)
async def test_malformed_bodies_are_400(engine, raw, fragment):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", raw)
    assert status == 400
    error = error_of(text)
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"verbosity": "low"}, "verbosity"),
        (
            {"stream_options": {"include_usage": True, "continuous": True}},
            "stream_options.continuous",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "cache_control": {}}]},
            "messages[0].cache_control",
        ),
    ],
)
async def test_strict_key_check_over_http(engine, extra, param):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", {**chat_body(), **extra})
    assert status == 400
    error = error_of(text)
    assert error["param"] == param
    assert param in error["message"]
    assert engine.requests == []


async def test_accepted_and_ignored_keys_over_http(engine):
    payload = chat_body(
        store=False,
        metadata={"k": "v"},
        user="me",
        stream_options=None,
        parallel_tool_calls=True,
        reasoning_effort="low",
        max_completion_tokens=64,
        logprobs=False,
        response_format={"type": "text"},
        chat_template_kwargs={"enable_thinking": True, "preserve_thinking": True},
    )
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", payload)
    assert status == 200, text


async def test_a_forced_call_the_grammar_cannot_express_is_400(engine):
    """A string parameter written unquoted cannot honour contentEncoding: the 400 names the
    parameter, before the engine sees the request."""
    tool = {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"b": {"type": "string", "contentEncoding": "base64"}}}}}
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(
            s, srv.v1 + "/chat/completions", chat_body(tools=[tool], tool_choice="required")
        )
    assert status == 400
    error = error_of(text)
    assert error["param"] == "tools[0].function.parameters.properties.b"
    assert "contentEncoding" in error["message"]
    assert engine.requests == []


async def test_history_the_renderer_refuses_is_400_naming_the_field(engine):
    call = {"id": "c", "type": "function", "function": {"name": "", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(
            s, srv.v1 + "/chat/completions", {**chat_body(), "messages": messages}
        )
    assert status == 400
    error = error_of(text)
    assert error["type"] == "invalid_request_error"
    assert "function.name" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_exceeded(stream):
    engine = ScriptedEngine(max_context=16)
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(
            s, srv.v1 + "/chat/completions", chat_body("word " * 100, stream=stream)
        )
    assert status == 400
    error = error_of(text)
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 16 tokens" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_busy_is_503_with_retry_after(engine, stream):
    engine.push("x", fail="busy")
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(
            s, srv.v1 + "/chat/completions", chat_body(stream=stream)
        )
    assert status == 503
    assert int(headers["Retry-After"]) >= 1
    assert error_of(text)["code"] == "server_busy"


@pytest.mark.parametrize("stream", [False, True])
async def test_internal_error_is_500_without_details(engine, stream):
    engine.push("x", fail="crash_before")
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(
            s, srv.v1 + "/chat/completions", chat_body(stream=stream)
        )
        after = await post(s, srv.v1 + "/chat/completions", chat_body())
    assert status == 500
    error = error_of(text)
    assert error["type"] == "server_error"
    assert "secret" not in text and "Traceback" not in text and "engine.py" not in text
    assert headers["X-Request-Id"] in error["message"]
    assert after[0] == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fail", "status", "code"), [("invalid", 400, None), ("failure_before", 500, "engine_failure")]
)
async def test_engine_refusals_before_output(engine, stream, fail, status, code):
    engine.push("x", fail=fail)
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        got, _, text = await post(s, srv.v1 + "/chat/completions", chat_body(stream=stream))
    assert got == status
    assert error_of(text)["code"] == code


async def test_engine_failure_mid_stream_is_an_error_event(engine, caplog):
    engine.push("a", "b", "c", "d", fail="failure_mid")
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(s, srv.v1 + "/chat/completions",
                                           chat_body(stream=True))
        whole = await post(s, srv.v1 + "/chat/completions", chat_body())
    assert status == 200
    events, _ = parse_sse(text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "error" in events[-1]
    assert events[-1]["error"]["type"] == "server_error"
    assert events[-1]["error"]["code"] == "engine_failure"
    # the internal text stays in the log; the error sent after a 200 is logged too
    assert "NPU timeout" not in events[-1]["error"]["message"]
    log = caplog.text
    assert "engine failure: NPU timeout" in log
    assert f"{headers['X-Request-Id']} stream ended with error 500 engine_failure" in log
    assert "[DONE]" not in events
    assert whole[0] == 200  # the next request is served


async def test_engine_failure_non_stream_is_500(engine):
    engine.push("a", "b", "c", "d", fail="failure_mid")
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", chat_body())
    assert status == 500
    assert error_of(text)["code"] == "engine_failure"


# ---- cancellation, keep-alive, shutdown ---------------------------------------------------


async def wait_for(predicate, timeout: float = 30.0) -> None:  # hang guard, not a timing
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_disconnect_mid_stream_cancels_generation(engine):
    engine.push(*["tok "] * 500, piece_delay_s=0.01)
    async with running_server(engine) as srv:
        async with (
            aiohttp.ClientSession() as s,
            s.post(srv.v1 + "/chat/completions", json=chat_body(stream=True)) as r,
        ):
            assert r.status == 200
            seen = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    seen += 1
                if seen >= 5:
                    break
        # the session is closed: the connection is gone
        await wait_for(lambda: engine.cancelled == 1)
        assert engine.completed == 0
        async with aiohttp.ClientSession() as s:
            status, _, text = await post(s, srv.v1 + "/chat/completions", chat_body())
        assert status == 200
        assert json.loads(text)["choices"][0]["message"]["content"] == "Hello world!"
        async with aiohttp.ClientSession() as s, s.get(srv.base + "/metrics") as r:
            metrics = await r.text()
    assert "ling3_client_disconnects_total 1.0" in metrics


async def test_disconnect_during_prefill_cancels_generation(engine):
    engine.push("late", prefill_delay_s=30)
    config = AppConfig(keep_alive_s=0.05)
    async with running_server(engine, config) as srv:
        async with (
            aiohttp.ClientSession() as s,
            s.post(srv.v1 + "/chat/completions", json=chat_body(stream=True)) as r,
        ):
            assert r.status == 200
            await r.content.readline()
        await wait_for(lambda: engine.cancelled == 1)
        async with aiohttp.ClientSession() as s:
            status, _, _ = await post(s, srv.v1 + "/chat/completions", chat_body())
        assert status == 200


async def test_non_stream_disconnect_cancels_generation(engine):
    engine.push("never", prefill_delay_s=30)
    async with running_server(engine) as srv:
        with pytest.raises(asyncio.TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
                await post(s, srv.v1 + "/chat/completions", chat_body())
        await wait_for(lambda: engine.cancelled == 1)


async def test_keep_alive_comments_during_long_prefill():
    """The prefill lasts until the client has seen two keep-alive comments (ordered by
    events: a fixed prefill delay could pass before two pings on a starved CPU)."""
    seen_pings = asyncio.Event()

    class GatedPrefill(ScriptedEngine):
        async def generate(self, request):
            async for event in super().generate(request):
                yield event
                if isinstance(event, Admitted):  # accepted: headers go out, then pings
                    await seen_pings.wait()

    engine = GatedPrefill()
    engine.push("</think>done")
    config = AppConfig(keep_alive_s=0.1)
    async with (
        running_server(engine, config) as srv,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s,  # hang guard
        s.post(srv.v1 + "/chat/completions", json=chat_body(stream=True)) as r,
    ):
        status, lines = r.status, []
        async for line in r.content:
            lines.append(line.decode())
            if sum(x.startswith(": keep-alive") for x in lines) == 2:
                seen_pings.set()
    text = "".join(lines)
    assert status == 200
    events, comments = parse_sse(text)
    assert len(comments) >= 2
    assert set(comments) == {": keep-alive"}
    assert events[-1] == "[DONE]"
    assert events[1]["choices"][0]["delta"] == {"content": "done"}


async def test_slow_admission_still_refuses_before_the_headers():
    """Encoding a huge prompt can take seconds (1.6 MB: ~0.9 s here, more on a board); the
    refusal still comes as the documented 400, never as 200 + an error event, and no
    keep-alive comment goes out before the request is accepted (issue 12, item 2)."""

    class SlowRefusal(ScriptedEngine):
        async def generate(self, request):
            await asyncio.sleep(1.5)  # longer than any header deadline would allow
            async for event in super().generate(request):
                yield event

    engine = SlowRefusal(max_context=16)
    config = AppConfig(keep_alive_s=0.05)
    async with running_server(engine, config) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(
            s, srv.v1 + "/chat/completions", chat_body("word " * 100, stream=True)
        )
    assert status == 400
    error = error_of(text)
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 16 tokens" in error["message"]


async def test_context_error_after_admission_is_an_error_event():
    """An engine that refuses only after admitting (not the real one) still gets the same
    code in an error event, which opencode maps to its compaction path."""

    class LateRefusal(ScriptedEngine):
        async def generate(self, request):
            yield Admitted(1)
            raise ContextLengthExceeded(40, 16)

    config = AppConfig(keep_alive_s=0.1)
    async with running_server(LateRefusal(), config) as srv, aiohttp.ClientSession() as s:
        status, _, text = await post(s, srv.v1 + "/chat/completions", chat_body(stream=True))
    assert status == 200
    events, _ = parse_sse(text)
    assert events[-1]["error"]["code"] == "context_length_exceeded"


async def test_shutdown_cancels_running_generations(engine):
    engine.push("a", fail="hang")
    chunks: list[bytes] = []
    async with aiohttp.ClientSession() as s:
        async with running_server(engine, AppConfig(shutdown_timeout_s=2)) as srv:
            response = await s.post(srv.v1 + "/chat/completions", json=chat_body(stream=True))
            assert response.status == 200
            await wait_for(lambda: engine.started == 1)
            await asyncio.sleep(0.05)
        async for line in response.content:
            chunks.append(line)
        response.release()
    text = b"".join(chunks).decode()
    assert '"code": "shutdown"' in text
    assert engine.cancelled == 1


async def test_sigterm_answers_every_running_and_queued_request(engine):
    """Running non-stream, queued stream and queued non-stream requests at shutdown: each
    gets exactly one complete answer or one error, never a dropped connection."""
    engine.push("a", fail="hang")  # the running one holds the single worker
    results: dict[str, tuple[int, str]] = {}

    async def call(session, url, name, stream):
        async with session.post(url, json=chat_body(stream=stream)) as response:
            results[name] = (response.status, await response.text())

    async with aiohttp.ClientSession() as s:
        async with running_server(engine, AppConfig(shutdown_timeout_s=5)) as srv:
            url = srv.v1 + "/chat/completions"
            tasks = [asyncio.create_task(call(s, url, "running", False))]
            await wait_for(lambda: engine.started == 1)
            tasks += [asyncio.create_task(call(s, url, "queued-stream", True)),
                      asyncio.create_task(call(s, url, "queued", False))]
            await wait_for(lambda: engine.stats().queue_depth == 2)
        await asyncio.gather(*tasks)
    assert set(results) == {"running", "queued-stream", "queued"}
    for name in ("running", "queued"):
        status, text = results[name]
        assert status == 503, (name, text)
        assert error_of(text)["code"] == "shutdown"
    status, text = results["queued-stream"]
    if status == 503:  # still before its headers
        assert error_of(text)["code"] == "shutdown"
    else:
        events, _ = parse_sse(text)
        assert status == 200 and events[-1]["error"]["code"] == "shutdown"


async def test_draining_server_refuses_new_work_and_fails_health(engine):
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        srv.app[STATE]["stopping"] = True  # what SIGTERM sets before the listener closes
        health = await s.get(srv.base + "/health")
        assert health.status == 503 and (await health.json())["status"] == "draining"
        status, headers, text = await post(s, srv.v1 + "/chat/completions", chat_body())
    assert status == 503 and headers["Retry-After"]
    assert error_of(text)["code"] == "shutdown"
    assert engine.started == 0


# ---- metrics -----------------------------------------------------------------------------


async def test_metrics_are_prometheus_text(engine):
    engine.push("a", "b", cached_tokens=5)
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        await post(s, srv.v1 + "/chat/completions", chat_body())
        await post(s, srv.v1 + "/chat/completions", chat_body(stream=True))
        await post(s, srv.v1 + "/chat/completions", {"bad": 1})
        async with s.get(srv.base + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    route = "/v1/chat/completions"
    assert samples[("ling3_http_requests_total", (("route", route), ("status", "200")))] == 2
    assert samples[("ling3_http_requests_total", (("route", route), ("status", "400")))] == 1
    stats = engine.stats()
    assert samples[("ling3_prompt_tokens_total", ())] == stats.prompt_tokens
    assert samples[("ling3_completion_tokens_total", ())] == stats.completion_tokens
    assert samples[("ling3_prefix_cache_hits_total", ())] == 1
    assert samples[("ling3_prefix_cache_reused_tokens_total", ())] == 5
    assert samples[("ling3_prefill_tokens_per_second", ())] == pytest.approx(
        stats.prefill_tokens / stats.prefill_seconds
    )
    assert samples[("ling3_decode_tokens_per_second", ())] == pytest.approx(
        stats.decode_tokens / stats.decode_seconds
    )
    assert samples[("ling3_queue_depth", ())] == 0
    assert samples[("ling3_npu_errors_total", ())] == 0
    assert samples[("ling3_model_ready", ())] == 1
    assert samples[("ling3_requests_in_flight", ())] == 0
    assert (
        samples[("ling3_chat_completions_total", (("finish_reason", "stop"), ("stream", "true")))]
        == 1
    )
    assert samples[("ling3_time_to_first_token_seconds_count", ())] == 2


async def test_history_arguments_as_object_or_string_render_the_same(engine):
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}

    def history(arguments) -> dict:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read", "arguments": arguments},
        }
        return chat_body(
            tools=[tool],
            messages=[
                {"role": "user", "content": "read a.py"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning": "need it",
                    "tool_calls": [call],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "x=1"}],
                },
            ],
        )

    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        for arguments in ('{"path": "a.py", "n": 2}', {"path": "a.py", "n": 2}):
            status, _, text = await post(s, srv.v1 + "/chat/completions", history(arguments))
            assert status == 200, text
    first, second = ("".join(seg.text for seg in r.prompt) for r in engine.requests)
    assert first == second
    assert (
        "<think>need it</think><tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py" in first
    )
    assert "<arg_key>n</arg_key>\n<arg_value>2</arg_value>" in first
    assert "<tool_response>\nx=1\n</tool_response>" in first


async def test_engine_refusing_synchronously_is_still_a_typed_error():
    """An engine whose ``generate`` is a plain function that raises at once."""
    from ling3_rknn.engine.api import EngineBusy

    class Refusing(ScriptedEngine):
        def generate(self, request):  # type: ignore[override]
            raise EngineBusy("3 requests are already waiting")

    async with running_server(Refusing()) as srv, aiohttp.ClientSession() as s:
        for stream in (False, True):
            status, headers, text = await post(
                s, srv.v1 + "/chat/completions", chat_body(stream=stream)
            )
            assert status == 503
            assert headers["Retry-After"]
            assert "already waiting" in error_of(text)["message"]


async def test_engine_loaded_by_the_app_is_closed_at_shutdown():
    loaded, handed_in = ScriptedEngine(), ScriptedEngine()
    async with running_server(loader=lambda: loaded) as srv:
        await wait_for(lambda: srv.holder.engine is loaded)
    async with running_server(handed_in):
        pass
    assert loaded.closed == 1
    assert handed_in.closed == 0


async def test_engine_that_stopped_being_ready_is_503(engine):
    engine.is_ready = False
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(s, srv.v1 + "/chat/completions", chat_body())
        async with s.get(srv.base + "/health") as r:
            health = r.status, await r.json()
    assert status == 503 and headers["Retry-After"]
    assert error_of(text)["code"] == "model_unavailable"
    assert health == (503, {"status": "unavailable"})


@pytest.mark.parametrize("raw", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n{}\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    b"GET /%s%d%%s HTTP/1.1\r\nHost: x\r\nX-Big: %s" + b"b" * 70_000 + b"\r\n\r\n",
], ids=["bad-content-length", "bad-chunk-size", "70KB-header", "percent-signs"])
async def test_malformed_http_is_a_400_and_one_warning_line(raw, caplog):
    async with running_server(ScriptedEngine()) as srv:
        host, port = srv.base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.read(64), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.0 400") or head.startswith(b"HTTP/1.1 400")
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelname == "WARNING" and r.exc_info is None for r in records)
    assert "malformed HTTP" in records[0].getMessage()  # formats: client bytes are data
    assert "Logging error" not in caplog.text


async def test_a_closed_engine_is_a_shutdown_503_not_a_model_failure():
    from ling3_rknn.engine import EngineShutDown

    class Closed(ScriptedEngine):
        async def generate(self, request):
            raise EngineShutDown("the engine is shut down")
            yield  # an async generator, like the real one

    async with running_server(Closed()) as srv, aiohttp.ClientSession() as s:
        status, headers, text = await post(s, srv.v1 + "/chat/completions", chat_body())
    assert status == 503 and headers["Retry-After"]
    assert error_of(text)["code"] == "shutdown"

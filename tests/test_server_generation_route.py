"""The one generation flow under every route: a client that leaves cancels the
generation, and a shutdown ends a running stream with the route's own error event,
whichever wire format the route writes (the chat route's cases: test_server_http.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from scripted_engine import ScriptedEngine
from server_harness import running_server

from ling3_rknn.server import AppConfig

ROUTES = {
    "responses": ("/responses", {"input": "hi"}),
    "messages": ("/messages", {"max_tokens": 1000,
                               "messages": [{"role": "user", "content": "hi"}]}),
}


async def wait_for(predicate, timeout: float = 30.0) -> None:  # hang guard, not a timing
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("route", ROUTES)
async def test_disconnect_mid_stream_cancels_generation(route):
    engine = ScriptedEngine()
    engine.push(*["tok "] * 500, piece_delay_s=0.01)
    path, body = ROUTES[route]
    async with running_server(engine) as srv:
        async with (aiohttp.ClientSession() as s,
                    s.post(srv.v1 + path, json={"model": "ling-3.0-tiny", "stream": True,
                                                **body}) as r):
            assert r.status == 200
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: ")
                if seen >= 8:
                    break
        await wait_for(lambda: engine.cancelled == 1)
        assert engine.completed == 0
        async with aiohttp.ClientSession() as s, s.get(srv.base + "/metrics") as r:
            metrics = await r.text()
    assert "ling3_client_disconnects_total 1.0" in metrics


@pytest.mark.parametrize(("route", "ending"), [
    ("responses", b'"type": "response.failed"'),
    ("messages", b'"type": "overloaded_error"'),
])
async def test_shutdown_ends_a_running_stream_with_the_routes_error(route, ending):
    engine = ScriptedEngine()
    engine.push("a", fail="hang")
    path, body = ROUTES[route]
    async with aiohttp.ClientSession() as s:
        async with running_server(engine, AppConfig(shutdown_timeout_s=2)) as srv:
            response = await s.post(srv.v1 + path, json={"model": "ling-3.0-tiny",
                                                         "stream": True, **body})
            assert response.status == 200
            await wait_for(lambda: engine.started == 1)
            await asyncio.sleep(0.05)
        text = await response.read()
        response.release()
    assert ending in text
    assert engine.cancelled == 1


@pytest.mark.parametrize("route", [*ROUTES, "chat"])
async def test_a_drain_that_begins_while_the_body_is_prepared_is_a_503(route, monkeypatch):
    """SIGTERM lands after the drain check at the top of the flow, while the body is still
    being read and checked: the flow looks again before admission, so the request gets a
    503 ``shutdown`` it can retry elsewhere and never reaches the engine."""
    from ling3_rknn.server import generation_route
    from ling3_rknn.server.state import STATE

    path, body = ROUTES.get(route, ("/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}]}))
    engine = ScriptedEngine()
    prepare = generation_route._prepare
    async with running_server(engine) as srv:
        def prepare_then_drain(*args):
            prepared = prepare(*args)
            srv.app[STATE]["stopping"] = True  # the drain begins here
            return prepared

        monkeypatch.setattr(generation_route, "_prepare", prepare_then_drain)
        async with aiohttp.ClientSession() as session, session.post(
                srv.v1 + path, json={"model": "ling-3.0-tiny", **body}) as r:
            assert r.status in (503, 529)  # 529: the Messages API's overloaded
            assert r.headers["Retry-After"] == "5"
            answer = await r.json()
        srv.app[STATE]["stopping"] = False
    assert "shut" in json_text(answer)
    assert engine.requests == []


def json_text(answer: dict) -> str:
    import json

    return json.dumps(answer)

"""Clients that leave early or announce too much, at the HTTP layer (scripted engine, raw
sockets): a hang-up part way through a body is a quiet 499, never a 500 with tracebacks;
``Expect: 100-continue`` with a declared body over the limit is a 413 before the body."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from scripted_engine import ScriptedEngine
from server_harness import running_server

from ling3_rknn.server import AppConfig

ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens"]


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


async def _metrics(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as r:
        return await r.text()


def _count(metrics: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(prefix))


async def _until(predicate, what: str) -> None:
    """Wait (event-loop turns, no timing bound of interest) until ``predicate()``."""
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


@pytest.mark.parametrize("path", ROUTES)
async def test_a_hang_up_part_way_through_the_body_is_a_quiet_499(path, caplog):
    """Ten clients announce 100 KB, send 10 bytes and close: each is one access-log line
    with 499, no traceback, counted as a disconnect and never as a 500."""
    caplog.set_level(logging.INFO)
    engine = ScriptedEngine()
    async with running_server(engine) as srv:
        for _ in range(10):
            _reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv.base))
            writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                         '{"model": "'.encode())
            await writer.drain()
            await asyncio.sleep(0.02)  # let the server start reading the body
            writer.close()
            await writer.wait_closed()
        await _until(lambda: sum(f" {path} 499 " in r.getMessage()
                                 for r in caplog.records) == 10, "ten 499 lines")
        metrics = await _metrics(srv.base)
    assert not [r for r in caplog.records if r.exc_info], "a hang-up wrote a traceback"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 'status="500"' not in metrics
    assert _count(metrics, f'ling3_http_requests_total{{route="{path}",status="499"}}') == 10
    assert _count(metrics, "ling3_client_disconnects_total") == 10
    assert _count(metrics, 'ling3_request_errors_total{kind="internal"}') == 0


@pytest.mark.parametrize("path", ROUTES)
async def test_expect_100_continue_over_the_limit_is_a_413_before_the_body(path):
    """A declared 20 MB body with ``Expect: 100-continue`` gets its 413 at once (no
    ``100 Continue``, no body read); one under the limit still gets ``100 Continue``."""
    async with running_server(ScriptedEngine(), AppConfig(max_body_bytes=1 << 20)) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv.base))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-continue\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {20 << 20}\r\n\r\n"
                     .encode())
        answer = await asyncio.wait_for(reader.read(), 10)  # closed after the 413
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:120]
        assert b"100 Continue" not in answer
        assert b"request_too_large" in answer or b"request_too_large" in answer.lower()

        reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv.base))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-continue\r\n"
                     "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 100 Continue"), head
        writer.close()


async def test_a_declared_body_over_the_limit_is_refused_before_it_is_read():
    """Without Expect, too: the declared length decides, so the server does not read
    megabytes it will refuse."""
    async with running_server(ScriptedEngine(), AppConfig(max_body_bytes=1 << 20)) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv.base))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n{")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:120]


class _Inner:
    """aiohttp's protocol as the guard sees it: records what it is handed."""

    def __init__(self) -> None:
        self.data = b""

    def connection_made(self, transport: object) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: object) -> None:
        pass


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("cut", range(1, 5))
async def test_the_header_deadline_ends_when_the_blank_line_arrives_split(cut):
    """The end of the headers (CRLF CRLF) split across two reads at every place: the
    header deadline is cancelled all the same (a tail kept one byte short missed the
    split after the first three bytes)."""
    from ling3_rknn.server.connections import ConnectionLimits, ConnectionTracker, _Guard

    tracker = ConnectionTracker(ConnectionLimits(max_connections=4, header_timeout_s=60.0))
    inner, transport = _Inner(), _Transport()
    guard = _Guard(inner, tracker)
    guard.connection_made(transport)  # type: ignore[arg-type]
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    split = len(head) - cut
    guard.data_received(head[:split])
    guard.data_received(head[split:])
    assert guard._deadline is None, f"deadline still armed with the blank line cut at {cut}"
    assert inner.data == head
    guard.connection_lost(None)
    assert tracker.open == 0

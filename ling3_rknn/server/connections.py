"""Connection-level limits every route shares: a cap on open connections below the
process's descriptor limit, and a deadline for a new connection's request headers.

aiohttp closes idle keep-alive connections, but a connection that opens and never
finishes its first request's headers (needing no API key) is kept forever: a few thousand
of them hold every file descriptor, and then every client, ``/health`` included, times
out while asyncio logs a traceback per refused ``accept``. Here each connection's
protocol is wrapped before aiohttp sees it: past the cap a connection is answered at once
with a 503 and closed, and one whose headers are not complete within the deadline is
closed. Each condition is logged as one line at most once a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

log = logging.getLogger("ling3_rknn.server")

# Descriptors kept for everything that is not a client connection (model and bundle files,
# the prefix cache's files, logs, onnxruntime's and the NPU driver's handles).
FD_RESERVE = 256
# A refused connection is half-closed after its 503 and closed this much later, so the
# request bytes still arriving do not make the kernel reset it before the client has read
# the answer; at most ``_LINGERING`` of them at once (past that: closed at once).
_LINGER_S = 1.0
_LINGERING = 64
_END_OF_HEADERS = b"\r\n\r\n"


def default_max_connections() -> int:
    """Open connections allowed: the descriptor limit less a reserve (systemd's
    ``LimitNOFILE=4096`` gives 3840), at least 16."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 65536
    return max(16, int(soft) - FD_RESERVE)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float


class RateLimitedLog:
    """One log line per condition per ``period_s``, with a count of what it stood for."""

    def __init__(self, period_s: float = 60.0) -> None:
        self._period = period_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._period:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        more = self._suppressed.pop(key, 0)
        self._last[key] = now
        log.warning("%s%s", message, f" ({more} more since the last report)" if more else "")


def _refusal() -> bytes:
    body = json.dumps({"error": {
        "message": "The server has too many open connections; retry shortly.",
        "type": "server_busy", "param": None, "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: 1\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Guard(asyncio.Protocol):
    """Wraps one connection's aiohttp protocol: counts it against the cap and closes it
    if its first request's headers do not arrive in time. Forwards every protocol call
    (aiohttp's handler only ever sees the transport and these calls)."""

    def __init__(self, inner: Any, tracker: ConnectionTracker) -> None:
        self._inner = inner
        self._tracker = tracker
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for an end of headers split across reads
        self._counted = False
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if not self._tracker.admit():
            self._refused = True
            self._refuse(transport)  # type: ignore[arg-type]
            return
        self._counted = True
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._tracker.limits.header_timeout_s, self._too_slow)
        self._inner.connection_made(transport)

    def _refuse(self, transport: asyncio.Transport) -> None:
        with contextlib.suppress(Exception):
            transport.write(_refusal())
        tracker = self._tracker
        if tracker.lingering >= _LINGERING or not transport.can_write_eof():
            transport.close()
            return
        with contextlib.suppress(Exception):
            transport.write_eof()
        tracker.lingering += 1
        self._deadline = asyncio.get_running_loop().call_later(_LINGER_S, transport.close)

    def _too_slow(self) -> None:
        self._deadline = None
        self._tracker.report_slow()
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._deadline is not None:
            seen = self._tail + data
            if _END_OF_HEADERS in seen:
                self._deadline.cancel()
                self._deadline = None
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
            if self._refused:
                self._tracker.lingering -= 1
        if self._counted:
            self._counted = False
            self._tracker.release()
        if not self._refused:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()


class ConnectionTracker:
    """Open connections of one server, against ``limits``."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0
        self.lingering = 0  # refused connections half-closed, waiting to close
        self.log = RateLimitedLog()

    def admit(self) -> bool:
        if self.open >= self.limits.max_connections:
            self.log.warning("cap", f"refusing connections: {self.open} are open, the cap "
                                    f"(--max-connections) is {self.limits.max_connections}")
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

    def report_slow(self) -> None:
        self.log.warning("slow", "closed a connection that sent no complete request headers "
                                 f"within {self.limits.header_timeout_s:g} s")

    def factory(self, make: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guard(make(), self)


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through a ``ConnectionTracker``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 tracker: ConnectionTracker) -> None:
        super().__init__(runner, host, port)
        self.tracker = tracker

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.tracker.factory(server), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address,
        )


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, tracker: ConnectionTracker) -> None:
    """asyncio reports a failed ``accept`` (out of descriptors after all: other users of
    them) with a traceback each time it retries; one line a minute says the same."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
            tracker.log.warning("accept", f"cannot accept connections: {exc.strerror or exc}")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)

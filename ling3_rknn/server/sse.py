"""Server-sent events framing for streamed completions.

Keep-alive comments (``: keep-alive``) go out whenever nothing was written for a while:
during a long prefill on the board and while a long tool call is held back, so proxies
and client read timeouts do not cut the stream. Every SSE parser ignores comment lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def encode_named_event(name: str, payload: dict[str, Any]) -> bytes:
    """An event with an ``event:`` line (Responses and Anthropic streams name each event;
    their SDKs dispatch on it)."""
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


class SseWriter:
    """Writes events to a prepared stream response; one writer per response."""

    def __init__(self, response: web.StreamResponse, keep_alive_s: float) -> None:
        self._response = response
        self._keep_alive_s = keep_alive_s
        self._lock = asyncio.Lock()
        self._last_write = time.monotonic()
        self._pinger: asyncio.Task[None] | None = None

    @staticmethod
    def headers(request_id: str) -> dict[str, str]:
        return {
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
            "X-Request-Id": request_id,
        }

    def start_keep_alive(self) -> None:
        if self._keep_alive_s > 0 and self._pinger is None:
            self._pinger = asyncio.create_task(self._ping_loop())

    async def stop_keep_alive(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await self._pinger
            self._pinger = None

    async def send(self, payload: dict[str, Any]) -> None:
        await self.write(encode_event(payload))

    async def write(self, data: bytes) -> None:
        async with self._lock:
            await self._response.write(data)
            self._last_write = time.monotonic()

    async def _ping_loop(self) -> None:
        while True:
            idle = time.monotonic() - self._last_write
            if idle >= self._keep_alive_s:
                await self.write(KEEP_ALIVE)
                idle = 0.0
            await asyncio.sleep(self._keep_alive_s - idle)

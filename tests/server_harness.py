"""Runs the real aiohttp server on 127.0.0.1 (ephemeral port) for the server tests,
with the same runner settings as ``ling3-rknn serve``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ling3_rknn.server import AppConfig, EngineHolder, create_app
from ling3_rknn.server.app import serving


@dataclass
class Running:
    app: web.Application
    holder: EngineHolder
    base: str  # e.g. http://127.0.0.1:41234

    @property
    def v1(self) -> str:
        return self.base + "/v1"


@contextlib.asynccontextmanager
async def running_server(
    engine: Any = None,
    config: AppConfig | None = None,
    *,
    loader: Callable[[], Any] | None = None,
) -> AsyncIterator[Running]:
    holder = EngineHolder(engine)
    app = create_app(holder, config, loader=loader)
    async with serving(app, "127.0.0.1", 0) as port:
        yield Running(app, holder, f"http://127.0.0.1:{port}")


def parse_sse(raw: str) -> tuple[list[Any], list[str]]:
    """Split an event-stream body into decoded ``data:`` payloads and comment lines.
    ``[DONE]`` is kept as the string ``"[DONE]"``."""
    assert raw.endswith("\n\n"), "the stream must end with a complete event"
    events: list[Any] = []
    comments: list[str] = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
    return events, comments


def chat_body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "ling-3.0-tiny", "messages": [{"role": "user", "content": content}], **extra}

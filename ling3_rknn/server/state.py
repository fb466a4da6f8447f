"""Shared state of the server app: its configuration, the engine slot and the typed keys
under which routes find them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ling3_rknn.engine.api import EngineProtocol
from ling3_rknn.server import errors
from ling3_rknn.server.metrics import ServerMetrics
from ling3_rknn.server.worker_share import WorkerShare


@dataclass(frozen=True)
class AppConfig:
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024  # long agent histories plus tool schemas
    keep_alive_s: float = 10.0
    model_aliases: tuple[str, ...] = ()
    shutdown_timeout_s: float = 10.0
    # After SIGTERM, how long the listener stays open answering /health and new requests
    # with 503 before running requests are ended: time for a load balancer to stop sending.
    drain_s: float = 0.0
    # A new connection must send its request headers within this, and a request its body
    # within ``body_timeout_s`` once its headers are in; slower ones are closed (408 for
    # a body), so silent connections cannot pile up.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # An idle keep-alive connection (or one that began its next request's headers and
    # stopped) is closed after this; aiohttp's own default without web.run_app is an hour.
    keepalive_timeout_s: float = 75.0
    # Open connections allowed (beyond it: 503 and close); None: the descriptor limit less
    # a reserve (server/connections.py).
    max_connections: int | None = None
    # Without an API key any web page the user opens could drive a loopback server (and,
    # by DNS rebinding, read its answers): a keyless server answers only requests whose
    # Host is a loopback name or one of ``allowed_hosts``, and whose Origin, when a browser
    # sends one, is a loopback origin or one of ``allowed_origins`` ("*": any).
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # Worker threads token counting may hold at once; None: a quarter of the default
    # thread pool, at least one (server/worker_share.py).
    count_threads: int | None = None


class EngineHolder:
    """The engine slot: empty while loading, then the engine, or the load error."""

    def __init__(self, engine: EngineProtocol | None = None) -> None:
        self.engine = engine
        self.load_error: str | None = None
        self.created = int(time.time())

    def require(self) -> EngineProtocol:
        if self.engine is None:
            raise errors.loading()
        if not self.engine.ready:
            raise errors.ApiError(
                503,
                "The model is not available.",
                type="server_error",
                code="model_unavailable",
                headers={"Retry-After": "5"},
            )
        return self.engine


ENGINE = web.AppKey("engine", EngineHolder)
CONFIG = web.AppKey("config", AppConfig)
METRICS = web.AppKey("metrics", ServerMetrics)
RUNNING = web.AppKey("running", set)
STATE = web.AppKey("state", dict)
COUNTING = web.AppKey("counting", WorkerShare)
# Typed request storage where this aiohttp has it (3.12+); a plain key on older ones.
RID: Any = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"

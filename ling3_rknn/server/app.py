"""The aiohttp application: middleware (request id, auth, error bodies in each API's shape,
access log, HTTP metrics) and routes. The generation routes (chat completions, Responses,
Anthropic Messages) share one flow (``generation_route``); start-up and shutdown live in
``lifecycle``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable

from aiohttp import web

from ling3_rknn.engine.api import EngineProtocol
from ling3_rknn.server import anthropic_api, errors
from ling3_rknn.server.chat_handler import chat_completions
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.lifecycle import (
    cancel_generations,
    loader_context,
    request_stop,
    run_server,
    serving,
)
from ling3_rknn.server.metrics import CONTENT_TYPE, ServerMetrics
from ling3_rknn.server.origin import check_host_and_origin
from ling3_rknn.server.responses import models_body
from ling3_rknn.server.responses_api import responses_route
from ling3_rknn.server.state import (
    CONFIG,
    ENGINE,
    METRICS,
    RID,
    RUNNING,
    STATE,
    AppConfig,
    EngineHolder,
)

log = logging.getLogger("ling3_rknn.server")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_OPEN_PATHS = frozenset({"/health"})

__all__ = ["AppConfig", "EngineHolder", "create_app", "request_stop", "run_server", "serving"]


def _request_id(request: web.Request) -> str:
    incoming = request.headers.get("X-Request-Id", "")
    return incoming if _REQUEST_ID.match(incoming) else "req-" + secrets.token_hex(8)


def _check_auth(request: web.Request, api_key: str | None) -> None:
    """``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic
    clients)."""
    if api_key is None or request.path in _OPEN_PATHS:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise errors.unauthorized()


def _anthropic_client(request: web.Request) -> bool:
    """Errors go out in the Anthropic shape on its routes and to every client that says it
    speaks that API (the SDKs send ``anthropic-version`` on every request)."""
    return (request.path.startswith(("/v1/messages", "/messages"))
            or "anthropic-version" in request.headers)


def _error_response(request: web.Request, error: ApiError, request_id: str) -> web.Response:
    if _anthropic_client(request):
        return anthropic_api.error_response(error, request_id)
    return error.response(request_id)


def _served_routes(app: web.Application) -> list[str]:
    return sorted({f"{r.method} {r.resource.canonical}" for r in app.router.routes()
                   if r.method != "HEAD" and r.resource is not None})


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    if exc.status == 404:
        return errors.not_found(
            f"Unknown route {request.method} {request.path}. This server serves: "
            + ", ".join(_served_routes(request.app)) + ".", code="unknown_route")
    return errors.from_http_exception(exc)


async def _read_body(request: web.Request, timeout_s: float) -> None:
    """Read the body (aiohttp keeps it for the handler's ``read()``) within ``timeout_s``:
    a client that sends headers and then trickles or withholds its body must not hold a
    connection and a handler forever. The body limit (413) applies as it reads."""
    if not request.body_exists:
        return
    try:
        await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        raise errors.ApiError(408, f"The request body did not arrive within {timeout_s:g} s.",
                              code="request_timeout") from None


def _route_label(request: web.Request) -> str:
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _envelope(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Request id, auth, error bodies, access log and HTTP metrics for every route."""
    request_id = _request_id(request)
    request[RID] = request_id
    started = time.monotonic()
    metrics = request.app[METRICS]
    response: web.StreamResponse | None = None
    try:
        config = request.app[CONFIG]
        # /health says only whether the model is up: open like it is to the key (HAProxy's
        # checks send their own Host).
        if config.api_key is None and request.path not in _OPEN_PATHS:
            check_host_and_origin(request.headers.get("Host"), request.headers.get("Origin"),
                                  config.allowed_hosts, config.allowed_origins)
        _check_auth(request, config.api_key)
        await _read_body(request, config.body_timeout_s)
        response = await handler(request)
    except ApiError as exc:
        response = _error_response(request, exc, request_id)
        metrics.errors.labels(errors.error_kind(exc)).inc()
        if exc.status == 408:  # the rest of the body is not worth waiting for
            response.force_close()
    except web.HTTPException as exc:
        error = _http_error(request, exc)
        metrics.errors.labels(errors.error_kind(error)).inc()
        response = _error_response(request, error, request_id)
    except Exception:
        log.exception("request %s failed", request_id)
        metrics.errors.labels("internal").inc()
        response = _error_response(request, errors.internal(request_id), request_id)
    else:
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
    finally:
        # 499: the client went away and the handler was cancelled before any response.
        status = response.status if response is not None else 499
        elapsed_ms = (time.monotonic() - started) * 1000
        metrics.http_requests.labels(_route_label(request), str(status)).inc()
        log.info("%s %s %s %d %.1fms", request_id, request.method, request.path, status, elapsed_ms)
    return response


async def _health(request: web.Request) -> web.Response:
    holder = request.app[ENGINE]
    if request.app[STATE].get("stopping"):  # SIGTERM: a load balancer stops sending
        return web.json_response({"status": "draining"}, status=503)
    if holder.load_error is not None:
        return web.json_response({"status": "error", "error": holder.load_error}, status=503)
    if holder.engine is None:
        return web.json_response({"status": "loading"}, status=503)
    if not holder.engine.ready:
        return web.json_response({"status": "unavailable"}, status=503)
    return web.json_response({"status": "ok", "model": holder.engine.model_id})


async def _models(request: web.Request) -> web.Response:
    holder = request.app[ENGINE]
    engine = holder.require()
    ids = [engine.model_id, *request.app[CONFIG].model_aliases]
    return web.json_response(models_body(ids, holder.created, engine.max_context))


async def _model(request: web.Request) -> web.Response:
    holder = request.app[ENGINE]
    engine = holder.require()
    wanted = request.match_info["model"]
    ids = [engine.model_id, *request.app[CONFIG].model_aliases]
    if wanted not in ids:
        raise errors.not_found(f"The model '{wanted}' does not exist.", "model_not_found", "model")
    return web.json_response(models_body([wanted], holder.created, engine.max_context)["data"][0])


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def create_app(
    holder: EngineHolder,
    config: AppConfig | None = None,
    *,
    loader: Callable[[], EngineProtocol] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> web.Application:
    """The aiohttp application. ``loader`` (run in a thread at start-up) fills ``holder``."""
    config = config or AppConfig()
    if config.api_key is not None and not config.api_key.strip():
        raise ValueError("api_key must not be empty: an empty Bearer token would pass")
    app = web.Application(middlewares=[_envelope], client_max_size=config.max_body_bytes)
    app[ENGINE] = holder
    app[CONFIG] = config
    app[RUNNING] = set()
    app[STATE] = {}
    app[METRICS] = ServerMetrics(lambda: holder.engine.stats() if holder.engine else None)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/responses", responses_route)
        app.router.add_post(f"{prefix}/messages", anthropic_api.messages_route)
        app.router.add_post(f"{prefix}/messages/count_tokens", anthropic_api.count_tokens)
        app.router.add_get(f"{prefix}/models", _models)
        app.router.add_get(f"{prefix}/models/{{model}}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.on_shutdown.append(cancel_generations)
    app.cleanup_ctx.append(loader_context(loader, on_load_error))
    return app

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
from aiohttp.web_urldispatcher import _default_expect_handler as _default_expect

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
    COUNTING,
    ENGINE,
    METRICS,
    RID,
    RUNNING,
    STATE,
    AppConfig,
    EngineHolder,
)
from ling3_rknn.server.worker_share import WorkerShare, counting_share

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


# A client's answer that never went out because the client went away first (nginx's
# convention): logged and counted, never an error of ours.
CLIENT_GONE = 499


def _too_large(max_body_bytes: int) -> ApiError:
    return ApiError(413, f"Request body too large: the limit is {max_body_bytes} bytes "
                         "(--max-body-bytes).", code="request_too_large")


async def _expect(request: web.Request) -> None:
    """``Expect: 100-continue``: a body declared over the limit gets no ``100 Continue``
    (the envelope answers 413 before it is sent); any other gets aiohttp's answer."""
    declared = request.content_length
    if declared is not None and declared > request.app[CONFIG].max_body_bytes:
        return
    await _default_expect(request)


async def _read_body(request: web.Request, timeout_s: float, max_body_bytes: int) -> None:
    """Read the body (aiohttp keeps it for the handler's ``read()``) within ``timeout_s``:
    a client that sends headers and then trickles or withholds its body must not hold a
    connection and a handler forever. A declared length over the limit is a 413 before
    any of it is read; an undeclared (chunked) one is cut at the limit as it is read."""
    if not request.body_exists:
        return
    declared = request.content_length
    if declared is not None and declared > max_body_bytes:
        raise _too_large(max_body_bytes)
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
    gone = False
    try:
        config = request.app[CONFIG]
        # /health says only whether the model is up: open like it is to the key (HAProxy's
        # checks send their own Host).
        if config.api_key is None and request.path not in _OPEN_PATHS:
            check_host_and_origin(request.headers.get("Host"), request.headers.get("Origin"),
                                  config.allowed_hosts, config.allowed_origins)
        _check_auth(request, config.api_key)
        await _read_body(request, config.body_timeout_s, config.max_body_bytes)
        response = await handler(request)
    except ApiError as exc:
        response = _error_response(request, exc, request_id)
        metrics.errors.labels(errors.error_kind(exc)).inc()
        if exc.status in (408, 413):  # the rest of the body is not worth waiting for
            response.force_close()
    except ConnectionError:
        # The client closed its connection part way (through its body, or before its
        # answer could go out): nothing to answer and nothing wrong here.
        gone = True
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
        # 499: the client went away (its handler was cancelled, or its connection failed
        # under a read) before any response.
        status = response.status if response is not None else CLIENT_GONE
        if response is None and not request.app[STATE].get("stopping"):
            metrics.disconnects.inc()
        elapsed_ms = (time.monotonic() - started) * 1000
        metrics.http_requests.labels(_route_label(request), str(status)).inc()
        log.info("%s %s %s %d %.1fms", request_id, request.method, request.path, status, elapsed_ms)
    if gone or response is None:
        raise asyncio.CancelledError  # aiohttp ends the request quietly; no one to answer
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
    app[COUNTING] = WorkerShare(config.count_threads or counting_share())
    app[METRICS] = ServerMetrics(lambda: holder.engine.stats() if holder.engine else None)
    for prefix in ("/v1", ""):
        for path, handler in (("/chat/completions", chat_completions),
                              ("/responses", responses_route),
                              ("/messages", anthropic_api.messages_route),
                              ("/messages/count_tokens", anthropic_api.count_tokens)):
            app.router.add_post(prefix + path, handler, expect_handler=_expect)
        app.router.add_get(f"{prefix}/models", _models)
        app.router.add_get(f"{prefix}/models/{{model}}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.on_shutdown.append(cancel_generations)
    app.cleanup_ctx.append(loader_context(loader, on_load_error))
    return app

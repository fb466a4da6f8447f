"""Routes, middlewares and lifecycle of the OpenAI-compatible server.

The HTTP API comes up before the model: ``/health`` answers 503 while the loader runs in a
thread and 200 once the engine is ready. Handlers are cancelled when their client goes
away (``handler_cancellation``), which cancels the generation through the engine's
iterator; SIGTERM stops accepting, cancels running generations and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ling3_rknn.engine.api import EngineProtocol
from ling3_rknn.server import errors
from ling3_rknn.server.completion import (
    Completion,
    ContentOut,
    DoneOut,
    ReasoningOut,
    ToolCallOut,
)
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.metrics import CONTENT_TYPE, ServerMetrics
from ling3_rknn.server.responses import (
    ChunkFactory,
    MessageBuilder,
    models_body,
    new_completion_id,
)
from ling3_rknn.server.sse import DONE, SseWriter
from ling3_rknn.server.validate import parse_chat_request, require_object

log = logging.getLogger("ling3_rknn.server")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class AppConfig:
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024  # long agent histories plus tool schemas
    keep_alive_s: float = 10.0
    model_aliases: tuple[str, ...] = ()
    # How long a streamed request holds its response headers back waiting for the engine's
    # first event, so that "busy" or "prompt too long" still become HTTP errors.
    header_wait_s: float = 1.0
    shutdown_timeout_s: float = 10.0


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


_ENGINE = web.AppKey("engine", EngineHolder)
_CONFIG = web.AppKey("config", AppConfig)
_METRICS = web.AppKey("metrics", ServerMetrics)
_RUNNING = web.AppKey("running", set)
_STATE = web.AppKey("state", dict)
# Typed request storage where this aiohttp has it (3.12+); a plain key on older ones.
_RID: Any = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"


def _request_id(request: web.Request) -> str:
    incoming = request.headers.get("X-Request-Id", "")
    return incoming if _REQUEST_ID.match(incoming) else "req-" + secrets.token_hex(8)


def _check_auth(request: web.Request, api_key: str | None) -> None:
    if api_key is None or request.path in _OPEN_PATHS:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise errors.unauthorized()


def _route_label(request: web.Request) -> str:
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _envelope(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Request id, auth, OpenAI error bodies, access log and HTTP metrics for every route."""
    request_id = _request_id(request)
    request[_RID] = request_id
    started = time.monotonic()
    metrics = request.app[_METRICS]
    response: web.StreamResponse | None = None
    try:
        _check_auth(request, request.app[_CONFIG].api_key)
        response = await handler(request)
    except ApiError as exc:
        response = exc.response(request_id)
    except web.HTTPException as exc:
        response = errors.from_http_exception(exc).response(request_id)
    except Exception:
        log.exception("request %s failed", request_id)
        response = errors.internal(request_id).response(request_id)
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
    holder = request.app[_ENGINE]
    if holder.load_error is not None:
        return web.json_response({"status": "error", "error": holder.load_error}, status=503)
    if holder.engine is None:
        return web.json_response({"status": "loading"}, status=503)
    if not holder.engine.ready:
        return web.json_response({"status": "unavailable"}, status=503)
    return web.json_response({"status": "ok", "model": holder.engine.model_id})


async def _models(request: web.Request) -> web.Response:
    holder = request.app[_ENGINE]
    engine = holder.require()
    ids = [engine.model_id, *request.app[_CONFIG].model_aliases]
    return web.json_response(models_body(ids, holder.created, engine.max_context))


async def _model(request: web.Request) -> web.Response:
    holder = request.app[_ENGINE]
    engine = holder.require()
    wanted = request.match_info["model"]
    ids = [engine.model_id, *request.app[_CONFIG].model_aliases]
    if wanted not in ids:
        raise errors.not_found(f"The model '{wanted}' does not exist.", "model_not_found", "model")
    return web.json_response(models_body([wanted], holder.created, engine.max_context)["data"][0])


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[_METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_request(f"The request body is not valid JSON: {exc}") from None
    return require_object(body)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    engine = app[_ENGINE].require()
    chat_request = parse_chat_request(await _read_json(request))
    if chat_request.model not in (engine.model_id, *app[_CONFIG].model_aliases):
        raise errors.not_found(
            f"The model '{chat_request.model}' does not exist; this server serves "
            f"'{engine.model_id}'.",
            "model_not_found",
            "model",
        )
    completion = Completion(engine, chat_request)
    metrics = app[_METRICS]
    task = asyncio.current_task()
    app[_RUNNING].add(task)
    metrics.in_flight.inc()
    try:
        if chat_request.stream:
            return await _stream(request, completion, engine.model_id)
        return await _whole(request, completion, engine.model_id)
    except asyncio.CancelledError:
        if not app[_STATE].get("stopping"):
            metrics.disconnects.inc()
        raise
    finally:
        metrics.in_flight.dec()
        app[_RUNNING].discard(task)
        await completion.close()


async def _whole(request: web.Request, completion: Completion, model: str) -> web.Response:
    metrics = request.app[_METRICS]
    started = time.monotonic()
    await completion.start()
    metrics.time_to_first_token.observe(time.monotonic() - started)
    message = MessageBuilder()
    done: DoneOut | None = None
    async for event in completion.events():
        if isinstance(event, ReasoningOut):
            message.reasoning.append(event.text)
        elif isinstance(event, ContentOut):
            message.content.append(event.text)
        elif isinstance(event, ToolCallOut):
            message.tool_calls.append(event)
        else:
            done = event
    assert done is not None
    _log_completion(request, metrics, False, done, started)
    body = message.body(
        new_completion_id(),
        model,
        int(time.time()),
        done.finish_reason,
        done.usage,
        done.reasoning_tokens,
    )
    return web.json_response(body, headers={"X-Request-Id": request[_RID]})


async def _stream(request: web.Request, completion: Completion, model: str) -> web.StreamResponse:
    app = request.app
    config, metrics = app[_CONFIG], app[_METRICS]
    chunks = ChunkFactory(new_completion_id(), model, completion.request.include_usage)
    started = time.monotonic()
    first = asyncio.ensure_future(completion.start())
    try:
        await asyncio.wait({first}, timeout=config.header_wait_s)
        if first.done():
            first.result()  # the engine's up-front refusals become plain HTTP errors
        response = web.StreamResponse(headers=SseWriter.headers(request[_RID]))
        try:
            await response.prepare(request)
        except ConnectionError:  # the client left while the engine was starting
            metrics.disconnects.inc()
            return response
        writer = SseWriter(response, config.keep_alive_s)
        writer.start_keep_alive()
        try:
            await writer.send(chunks.role())
            await _stream_events(request, writer, chunks, completion, first, started)
        except ApiError as exc:
            await _send_error(writer, exc)
        except asyncio.CancelledError:
            if not app[_STATE].get("stopping"):
                raise
            # Our own shutdown cancelled the generation: tell the client and end the stream
            # cleanly instead of cutting the connection.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_send_error(writer, _shutdown_error()), 1.0)
        except ConnectionError:
            metrics.disconnects.inc()
            return response
        except Exception:
            log.exception("stream %s failed", request[_RID])
            await _send_error(writer, errors.internal(request[_RID]))
        finally:
            await writer.stop_keep_alive()
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
    finally:
        if not first.done():
            first.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await first  # always retrieved, so no "exception was never retrieved" at exit


async def _send_error(writer: SseWriter, error: ApiError) -> None:
    """Errors after the headers went out are an ``error`` event (serving-protocol.md 3.3);
    a client that is already gone does not need one."""
    with contextlib.suppress(ConnectionError):
        await writer.send(error.body())


async def _stream_events(
    request: web.Request,
    writer: SseWriter,
    chunks: ChunkFactory,
    completion: Completion,
    first: asyncio.Future,
    started: float,
) -> None:
    metrics = request.app[_METRICS]
    await first
    metrics.time_to_first_token.observe(time.monotonic() - started)
    async for event in completion.events():
        if isinstance(event, ContentOut):
            await writer.write(chunks.content_event(event.text))
        elif isinstance(event, ReasoningOut):
            await writer.write(chunks.reasoning_event(event.text))
        elif isinstance(event, ToolCallOut):
            await writer.send(chunks.tool_call(event))
        else:
            await writer.send(chunks.finish(event.finish_reason))
            if chunks.include_usage:
                await writer.send(chunks.usage(event.usage, event.reasoning_tokens))
            await writer.write(DONE)
            _log_completion(request, metrics, True, event, started)


def _log_completion(
    request: web.Request, metrics: ServerMetrics, stream: bool, done: DoneOut, started: float
) -> None:
    metrics.completions.labels(str(stream).lower(), done.finish_reason).inc()
    usage = done.usage
    log.info(
        "%s completion stream=%s finish=%s prompt=%d cached=%d completion=%d %.0fms",
        request[_RID],
        stream,
        done.finish_reason,
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        (time.monotonic() - started) * 1000,
    )


def _shutdown_error() -> ApiError:
    return ApiError(503, "The server is shutting down.", type="server_error", code="shutdown")


async def _cancel_generations(app: web.Application) -> None:
    """on_shutdown: the listener is already closed; end what is still generating."""
    app[_STATE]["stopping"] = True
    running = [task for task in app[_RUNNING] if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=app[_CONFIG].shutdown_timeout_s)


def _loader_context(
    loader: Callable[[], EngineProtocol] | None,
    on_load_error: Callable[[BaseException], None] | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        holder = app[_ENGINE]
        task: asyncio.Task[None] | None = None

        async def load() -> None:
            assert loader is not None
            try:
                holder.engine = await asyncio.get_running_loop().run_in_executor(None, loader)
                log.info("model %s ready", holder.engine.model_id)
            except Exception as exc:
                holder.load_error = f"{type(exc).__name__}: {exc}"
                log.error("model failed to load: %s", holder.load_error)
                if on_load_error is not None:
                    on_load_error(exc)

        if loader is not None:
            task = asyncio.create_task(load())
        yield
        if task is None:
            return  # the engine was handed in; its owner closes it
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # The app loaded the engine, so it closes it: stop the worker, flush the prefix
        # cache to disk so a restarted service keeps its warm prompts.
        close = getattr(holder.engine, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
            log.info("engine closed")

    return context


def create_app(
    holder: EngineHolder,
    config: AppConfig | None = None,
    *,
    loader: Callable[[], EngineProtocol] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> web.Application:
    """The aiohttp application. ``loader`` (run in a thread at start-up) fills ``holder``."""
    config = config or AppConfig()
    app = web.Application(middlewares=[_envelope], client_max_size=config.max_body_bytes)
    app[_ENGINE] = holder
    app[_CONFIG] = config
    app[_RUNNING] = set()
    app[_STATE] = {}
    app[_METRICS] = ServerMetrics(lambda: holder.engine.stats() if holder.engine else None)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", _chat_completions)
        app.router.add_get(f"{prefix}/models", _models)
        app.router.add_get(f"{prefix}/models/{{model}}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.on_shutdown.append(_cancel_generations)
    app.cleanup_ctx.append(_loader_context(loader, on_load_error))
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` until the block exits; yields the bound port (``port=0`` picks one)."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its generation
        access_log=None,  # the envelope middleware logs every request with its id
        shutdown_timeout=app[_CONFIG].shutdown_timeout_s,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        yield bound
    finally:
        await runner.cleanup()


async def run_server(app: web.Application, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    app[_STATE]["stop"] = stop
    async with serving(app, host, port) as bound:
        log.info("listening on http://%s:%d", host, bound)
        await stop.wait()
        log.info("shutting down")


def request_stop(app: web.Application) -> None:
    """Ask ``run_server`` to stop (used when the model fails to load)."""
    stop = app[_STATE].get("stop")
    if stop is not None:
        stop.set()

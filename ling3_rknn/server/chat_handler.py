"""``POST /v1/chat/completions``: one request from JSON body to a JSON answer or an SSE
stream, with the engine's refusals mapped to HTTP errors (before the headers) or to an
``error`` event (after them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from ling3_rknn.chat.events import ContentDelta, Finished, ReasoningDelta, ToolCallParsed
from ling3_rknn.engine.api import EngineProtocol
from ling3_rknn.server import errors
from ling3_rknn.server.completion import Completion, CompletionEvent
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.metrics import ServerMetrics
from ling3_rknn.server.responses import ChunkFactory, MessageBuilder, new_completion_id
from ling3_rknn.server.sse import DONE, SseWriter
from ling3_rknn.server.state import CONFIG, ENGINE, METRICS, RID, RUNNING, STATE
from ling3_rknn.server.validate import parse_chat_request, require_object

log = logging.getLogger("ling3_rknn.server")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; anything else is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_request(f"The request body is not valid JSON: {exc}") from None
    return require_object(body)


async def _read_json(request: web.Request) -> dict[str, Any]:
    return parse_json(await request.read())


def _prepare(raw: bytes, engine: EngineProtocol, models: tuple[str, ...],
             request_id: str) -> Completion:
    """Body to a ready Completion: parsing, validation, rendering and the grammar's text.
    Their cost grows with what the client sent (a 16 MB body, 2,000 tools), so this runs
    in a worker thread, never on the event loop every other client needs."""
    chat_request = parse_chat_request(parse_json(raw))
    if chat_request.model not in models:
        raise errors.not_found(
            f"The model '{chat_request.model}' does not exist; this server serves "
            f"'{engine.model_id}'.",
            "model_not_found",
            "model",
        )
    return Completion(engine, chat_request, request_id)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    if app[STATE].get("stopping"):  # a keep-alive connection during the drain
        raise errors.shutdown()
    engine = app[ENGINE].require()
    raw = await request.read()
    models = (engine.model_id, *app[CONFIG].model_aliases)
    completion = await asyncio.to_thread(_prepare, raw, engine, models, request[RID])
    chat_request = completion.request
    metrics = app[METRICS]
    task = asyncio.current_task()
    if app[STATE].get("stopping"):  # the drain began while the body was being read
        raise errors.shutdown()
    app[RUNNING].add(task)
    metrics.in_flight.inc()
    try:
        if chat_request.stream:
            return await _stream(request, completion, engine.model_id)
        return await _whole(request, completion, engine.model_id)
    except asyncio.CancelledError:
        if not app[STATE].get("stopping"):
            metrics.disconnects.inc()
            raise
        # Our shutdown cancelled a request whose headers are not out yet (a non-stream one,
        # running or queued, or a stream still waiting for its first event): it gets a 503
        # it can retry elsewhere, never a dropped connection. Streams already answering end
        # with an error event inside _stream.
        return errors.shutdown().response(request[RID])
    finally:
        metrics.in_flight.dec()
        app[RUNNING].discard(task)
        await completion.close()



async def _timed_events(completion: Completion, metrics: ServerMetrics, started: float
                        ) -> AsyncIterator[CompletionEvent]:
    """The completion's events, observing the time to the first one."""
    first = True
    async for event in completion.events():
        if first:
            metrics.time_to_first_token.observe(time.monotonic() - started)
            first = False
        yield event

async def _whole(request: web.Request, completion: Completion, model: str) -> web.Response:
    metrics = request.app[METRICS]
    started = time.monotonic()
    await completion.start()
    message = MessageBuilder()
    done: Finished | None = None
    async for event in _timed_events(completion, metrics, started):
        if isinstance(event, ReasoningDelta):
            message.reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            message.content.append(event.text)
        elif isinstance(event, ToolCallParsed):
            message.tool_calls.append(event)
        else:
            done = event
    assert done is not None
    _log_completion(request, metrics, False, done, started, completion.constrained)
    body = message.body(
        new_completion_id(),
        model,
        int(time.time()),
        done.finish_reason,
        done.usage,
    )
    return web.json_response(body, headers={"X-Request-Id": request[RID]})


async def _stream(request: web.Request, completion: Completion, model: str) -> web.StreamResponse:
    app = request.app
    config, metrics = app[CONFIG], app[METRICS]
    chunks = ChunkFactory(new_completion_id(), model, completion.request.include_usage)
    started = time.monotonic()
    # Admission first: every refusal that needs no generation (busy, prompt too long) is
    # a plain HTTP error, however long encoding a huge prompt takes; keep-alive comments
    # start only once the request is accepted.
    first = asyncio.ensure_future(completion.start())
    try:
        await first
        response = web.StreamResponse(headers=SseWriter.headers(request[RID]))
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
            await _send_error(writer, exc, request[RID], metrics)
        except asyncio.CancelledError:
            if not app[STATE].get("stopping"):
                raise
            # Our own shutdown cancelled the generation: tell the client and end the stream
            # cleanly instead of cutting the connection.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    _send_error(writer, errors.shutdown(), request[RID], metrics), 1.0)
        except ConnectionError:
            metrics.disconnects.inc()
            return response
        except Exception:
            log.exception("stream %s failed", request[RID])
            await _send_error(writer, errors.internal(request[RID]), request[RID], metrics)
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


async def _send_error(writer: SseWriter, error: ApiError, request_id: str,
                      metrics: ServerMetrics | None = None) -> None:
    """Errors after the headers went out are an ``error`` event (docs/serving.md 6.5);
    a client that is already gone does not need one. The access log says 200 for such a
    stream, so the error is logged here."""
    log.warning("%s stream ended with error %d %s: %s", request_id, error.status,
                error.code or error.type, error.message)
    if metrics is not None:
        metrics.errors.labels(errors.error_kind(error)).inc()
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
    metrics = request.app[METRICS]
    await first
    async for event in _timed_events(completion, metrics, started):
        if isinstance(event, ContentDelta):
            await writer.write(chunks.content_event(event.text))
        elif isinstance(event, ReasoningDelta):
            await writer.write(chunks.reasoning_event(event.text))
        elif isinstance(event, ToolCallParsed):
            await writer.send(chunks.tool_call(event))
        else:
            await writer.send(chunks.finish(event.finish_reason))
            if chunks.include_usage:
                await writer.send(chunks.usage(event.usage))
            await writer.write(DONE)
            _log_completion(request, metrics, True, event, started, completion.constrained)


def _log_completion(
    request: web.Request, metrics: ServerMetrics, stream: bool, done: Finished, started: float,
    constrained: str | None = None,
) -> None:
    metrics.completions.labels(str(stream).lower(), done.finish_reason).inc()
    if constrained is not None:
        metrics.constrained.labels(constrained).inc()
    usage = done.usage
    log.info(
        "%s completion stream=%s finish=%s constrained=%s prompt=%d cached=%d completion=%d "
        "%.0fms",
        request[RID],
        stream,
        done.finish_reason,
        constrained or "no",
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        (time.monotonic() - started) * 1000,
    )

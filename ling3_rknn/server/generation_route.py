"""The one handler flow of every generation route (chat completions, Responses, Anthropic
Messages): drain check, body, model check, admission, stream or whole answer, cancellation
on disconnect, metrics, error events and the completion log line.

A route is a ``WireApi``: a reader from its JSON body to the one internal ``ChatRequest``
(plus whatever its writer must echo back) and a writer from the token-event vocabulary
(``chat.events``) to its wire format. Nothing here knows a wire format, so the three routes
cannot drift apart in how they admit, cancel, count or fail (docs/serving.md 6 and 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from ling3_rknn.chat.events import Finished
from ling3_rknn.server import errors
from ling3_rknn.server.completion import Completion, CompletionEvent
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.metrics import ServerMetrics
from ling3_rknn.server.param_names import renamed
from ling3_rknn.server.sse import SseWriter
from ling3_rknn.server.state import CONFIG, ENGINE, METRICS, RID, RUNNING, STATE
from ling3_rknn.server.validate import ChatRequest, require_object

log = logging.getLogger("ling3_rknn.server")


class WireWriter(Protocol):
    """One answer in one wire format. The flow feeds it every event, streamed or not; for a
    stream it returns the bytes to send (``b""``: nothing yet), and a whole answer is
    ``body()`` once the generation finished."""

    def opening(self, prompt_tokens: int) -> bytes:
        """What a stream sends right after its headers (role chunk, ``response.created``);
        ``prompt_tokens`` is the prompt's size as admitted (its cache hit is known only at
        the end)."""
        ...

    def event(self, event: CompletionEvent) -> bytes:
        """One reasoning / content delta or tool call."""
        ...

    def finish(self, done: Finished) -> bytes:
        """The stream's closing events (finish reason, usage, terminator)."""
        ...

    def body(self, done: Finished) -> dict[str, Any]:
        """The non-streamed answer."""
        ...

    def error_event(self, error: ApiError) -> bytes:
        """An error after the stream's headers went out, in the format's own shape."""
        ...


@dataclass(frozen=True)
class WireApi:
    """A wire format as a front end: ``read`` checks a JSON body and returns the internal
    request and the reader's notes for the writer (e.g. fields to echo); ``writer`` builds
    the answer's writer."""

    name: str  # the log's name for it
    read: Callable[[dict[str, Any]], tuple[ChatRequest, Any]]
    writer: Callable[[ChatRequest, Any, str, bool], WireWriter]  # (request, notes, model, stream)


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; anything else is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_request(f"The request body is not valid JSON: {exc}") from None
    return require_object(body)


def served_models(request: web.Request) -> tuple[str, ...]:
    """The served id and its aliases (the first: the served id)."""
    return (request.app[ENGINE].require().model_id, *request.app[CONFIG].model_aliases)


def check_model(model: str, models: tuple[str, ...]) -> None:
    """A model that is neither the served id nor an alias is a 404 naming both."""
    if model not in models:
        raise errors.not_found(
            f"The model {errors.shown(model)} does not exist; this server serves "
            f"'{models[0]}'.",
            "model_not_found",
            "model",
        )


def _prepare(api: WireApi, raw: bytes, engine: Any, models: tuple[str, ...],
             request_id: str) -> tuple[Completion, WireWriter]:
    """Body to a ready Completion and its writer: JSON parsing, the reader's checks,
    rendering and the grammar's text. Their cost grows with what the client sent (a 16 MB
    body, 2,000 tools), so this runs in a worker thread, never on the event loop every
    other client needs."""
    chat_request, notes = api.read(parse_json(raw))
    try:
        check_model(chat_request.model, models)
        completion = Completion(engine, chat_request, request_id)
    except ApiError as exc:
        raise renamed(chat_request.names, exc) from None
    return completion, api.writer(chat_request, notes, engine.model_id, chat_request.stream)


def route(api: WireApi) -> Callable[[web.Request], Any]:
    """The aiohttp handler of ``api``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await serve(request, api)

    handle.__name__ = f"{api.name}_route"
    return handle


async def serve(request: web.Request, api: WireApi) -> web.StreamResponse:
    app = request.app
    if app[STATE].get("stopping"):  # a keep-alive connection during the drain
        raise errors.shutdown()
    engine = app[ENGINE].require()
    raw = await request.read()
    completion, writer = await asyncio.to_thread(_prepare, api, raw, engine,
                                                 served_models(request), request[RID])
    chat_request = completion.request
    metrics = app[METRICS]
    task = asyncio.current_task()
    if app[STATE].get("stopping"):  # the drain began while the body was being read
        raise errors.shutdown()
    app[RUNNING].add(task)
    metrics.in_flight.inc()
    try:
        if chat_request.stream:
            return await _stream(request, api, completion, writer)
        return await _whole(request, api, completion, writer)
    except ApiError as exc:  # the engine's refusals, in this API's own names
        raise renamed(chat_request.names, exc) from None
    except asyncio.CancelledError:
        if not app[STATE].get("stopping"):
            raise  # the client left: the envelope logs and counts it (499)
        # Our shutdown cancelled a request whose headers are not out yet (a non-stream one,
        # running or queued, or a stream still waiting for its first event): it gets a 503
        # it can retry elsewhere, never a dropped connection. Streams already answering end
        # with an error event inside _stream.
        raise errors.shutdown() from None
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


async def _whole(request: web.Request, api: WireApi, completion: Completion,
                 writer: WireWriter) -> web.Response:
    metrics = request.app[METRICS]
    started = time.monotonic()
    await completion.start()
    done: Finished | None = None
    async for event in _timed_events(completion, metrics, started):
        if isinstance(event, Finished):
            done = event
        else:
            writer.event(event)
    assert done is not None
    _log_completion(request, api, False, done, started, completion.constrained)
    return web.json_response(writer.body(done), headers={"X-Request-Id": request[RID]})


async def _stream(request: web.Request, api: WireApi, completion: Completion,
                  writer: WireWriter) -> web.StreamResponse:
    app = request.app
    config, metrics = app[CONFIG], app[METRICS]
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
        sse = SseWriter(response, config.keep_alive_s)
        sse.start_keep_alive()
        try:
            await sse.write(writer.opening(completion.prompt_tokens))
            async for event in _timed_events(completion, metrics, started):
                if isinstance(event, Finished):
                    await sse.write(writer.finish(event))
                    _log_completion(request, api, True, event, started, completion.constrained)
                else:
                    data = writer.event(event)
                    if data:
                        await sse.write(data)
        except ApiError as exc:
            await _send_error(sse, writer, renamed(completion.request.names, exc),
                              request[RID], metrics)
        except asyncio.CancelledError:
            if not app[STATE].get("stopping"):
                raise
            # Our own shutdown cancelled the generation: tell the client and end the stream
            # cleanly instead of cutting the connection.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    _send_error(sse, writer, errors.shutdown(), request[RID], metrics), 1.0)
        except ConnectionError:
            metrics.disconnects.inc()
            return response
        except Exception:
            log.exception("stream %s failed", request[RID])
            await _send_error(sse, writer, errors.internal(request[RID]), request[RID],
                              metrics)
        finally:
            await sse.stop_keep_alive()
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
    finally:
        if not first.done():
            first.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await first  # always retrieved, so no "exception was never retrieved" at exit


async def _send_error(sse: SseWriter, writer: WireWriter, error: ApiError,
                      request_id: str, metrics: ServerMetrics) -> None:
    """Errors after the headers went out are an event in the format's shape (docs/serving.md
    6.5); a client that is already gone does not need one. The access log says 200 for such
    a stream, so the error is logged here."""
    log.warning("%s stream ended with error %d %s: %s", request_id, error.status,
                error.code or error.type, error.message)
    metrics.errors.labels(errors.error_kind(error)).inc()
    with contextlib.suppress(ConnectionError):
        await sse.write(writer.error_event(error))


def _log_completion(
    request: web.Request, api: WireApi, stream: bool, done: Finished, started: float,
    constrained: str | None = None,
) -> None:
    metrics = request.app[METRICS]
    metrics.completions.labels(str(stream).lower(), done.finish_reason).inc()
    if constrained is not None:
        metrics.constrained.labels(constrained).inc()
    usage = done.usage
    log.info(
        "%s completion api=%s stream=%s finish=%s constrained=%s prompt=%d cached=%d "
        "completion=%d %.0fms",
        request[RID],
        api.name,
        stream,
        done.finish_reason,
        constrained or "no",
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        (time.monotonic() - started) * 1000,
    )

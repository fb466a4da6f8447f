"""Start-up and shutdown: the model loads in a thread while the API already answers,
clients that go away cancel their handlers, and SIGTERM stops accepting, ends running
generations and closes the engine the app loaded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ling3_rknn.engine.api import EngineProtocol
from ling3_rknn.server.connections import (
    ConnectionLimits,
    ConnectionTracker,
    GuardedSite,
    default_max_connections,
    quiet_accept_errors,
)
from ling3_rknn.server.sd_notify import notify
from ling3_rknn.server.state import CONFIG, ENGINE, RUNNING, STATE

log = logging.getLogger("ling3_rknn.server")


async def cancel_generations(app: web.Application) -> None:
    """on_shutdown: the listener is already closed; end what is still generating."""
    app[STATE]["stopping"] = True
    running = [task for task in app[RUNNING] if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=app[CONFIG].shutdown_timeout_s)


def loader_context(
    loader: Callable[[], EngineProtocol] | None,
    on_load_error: Callable[[BaseException], None] | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        holder = app[ENGINE]
        task: asyncio.Task[None] | None = None

        async def load() -> None:
            assert loader is not None
            try:
                holder.engine = await asyncio.get_running_loop().run_in_executor(None, loader)
                log.info("model %s ready", holder.engine.model_id)
                notify("READY=1")
            except Exception as exc:
                # /health needs no key, so it names the error class only; the log has all.
                holder.load_error = type(exc).__name__
                log.error("model failed to load: %s: %s", type(exc).__name__, exc)
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


class _ProtocolLog(logging.LoggerAdapter):
    """aiohttp's connection logger: a client's malformed HTTP (bad Content-Length or chunk
    size, a 70 KB header line) already got its 400 from aiohttp and is one warning line,
    not an error with a stack; anything else aiohttp reports keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: object = True,
                  **kwargs: object) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(exc, HttpProcessingError):
            # The message may quote the client's bytes: it is an argument, never a format.
            where = str(msg) % args if args else str(msg)
            detail = (exc.message or type(exc).__name__).splitlines()[0][:200]
            self.logger.warning("%s: malformed HTTP (%s: %s)", where, exc.code, detail)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` until the block exits; yields the bound port (``port=0`` picks one)."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its generation
        access_log=None,  # the envelope middleware logs every request with its id
        logger=_ProtocolLog(logging.getLogger("aiohttp.server"), {}),
        shutdown_timeout=app[CONFIG].shutdown_timeout_s,
        # After an answer sent before its body was read (413, 408), aiohttp reads and drops
        # the rest for this long so the client sees the answer; 10 s by default, which a
        # client that never sends the rest holds a connection for.
        lingering_time=2.0,
        keepalive_timeout=app[CONFIG].keepalive_timeout_s,
    )
    await runner.setup()
    config = app[CONFIG]
    tracker = ConnectionTracker(ConnectionLimits(
        config.max_connections or default_max_connections(), config.header_timeout_s))
    quiet_accept_errors(asyncio.get_running_loop(), tracker)
    try:
        site = GuardedSite(runner, host, port, tracker)
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
    app[STATE]["stop"] = stop
    async with serving(app, host, port) as bound:
        log.info("listening on http://%s:%d", host, bound)
        await stop.wait()
        app[STATE]["stopping"] = True  # /health and new requests answer 503 from now on
        notify("STOPPING=1")
        drain = app[CONFIG].drain_s
        if drain > 0:
            log.info("draining for %.0f s before shutting down", drain)
            await asyncio.sleep(drain)
        log.info("shutting down")


def request_stop(app: web.Application) -> None:
    """Ask ``run_server`` to stop (used when the model fails to load)."""
    stop = app[STATE].get("stop")
    if stop is not None:
        stop.set()

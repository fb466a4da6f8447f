"""A bounded share of the worker threads for one kind of request-controlled work.

Every request's parsing, rendering and encoding runs in asyncio's default thread pool
(``min(32, cores + 4)`` threads), off the event loop. Token counting answers no one in
the engine's queue, so nothing else limits how many counts run at once: eight clients
counting large bodies held every thread, and a chat request's own parsing and encoding
waited behind them for seconds. A ``WorkerShare`` lets at most ``size`` such jobs hold a
thread; the rest wait their turn without holding one (and a client that leaves while
waiting costs nothing). A job whose client left keeps its place until its thread is
really free, so clients that send and hang up cannot take more than the share either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def default_pool_threads() -> int:
    """The default executor's size (``concurrent.futures.ThreadPoolExecutor``'s rule)."""
    return min(32, (os.cpu_count() or 1) + 4)


def counting_share(pool_threads: int | None = None) -> int:
    """Threads token counting may hold at once: a quarter of the pool, at least one (6
    threads on a 2-core host: 1; 12 on the RK3588's 8 cores: 3). The rest stay free for
    the generation routes, whose own queue bounds them."""
    return max(1, (pool_threads or default_pool_threads()) // 4)


class WorkerShare:
    """At most ``size`` jobs of one kind in worker threads at a time."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a worker share needs at least one thread")
        self.size = size
        self._slots = asyncio.Semaphore(size)
        self.running = 0  # jobs holding a thread now (for tests and the bench)

    async def _hold(self) -> None:
        await self._slots.acquire()
        self.running += 1

    def _release(self) -> None:
        self.running -= 1
        self._slots.release()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """A slot for the block: for work that runs its own thread and stops it when
        cancelled (the engine's bounded encoding)."""
        await self._hold()
        try:
            yield
        finally:
            self._release()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread once a slot is free. Cancelling the caller
        stops the wait at once; a thread already running keeps the slot until it ends
        (its result is dropped)."""
        await self._hold()
        try:
            job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        except BaseException:
            self._release()
            raise
        job.add_done_callback(self._finished)
        return await asyncio.shield(job)

    def _finished(self, job: asyncio.Future[Any]) -> None:
        self._release()
        if not job.cancelled():
            job.exception()  # retrieved: a caller that left must not leave it unread

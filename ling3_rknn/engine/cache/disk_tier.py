"""The prefix cache's disk tier: snapshot files, their writer thread and their bytes.

The cache (engine/cache/prefix_cache.py) owns one and decides which entry lives where; the
tier keeps the files. It writes a snapshot off the request path (a background thread
exports and writes it; the export is cheap, since the snapshot hands over its frozen
latent blocks as they are), counts each file and each content-addressed block once
however many files reference the block, deletes a file together with the blocks no
other file references, and reads a file back into a snapshot (verified by the store).

It has no lock of its own: the cache calls it under the cache's lock, and the writer
thread touches only the store before it hands the result to the cache's callback, which
takes that lock. A written file is "unattached" until the cache either ``attach``es it to
its entry or ``discard``s it (the entry was evicted while it was being written).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ling3_rknn.model.snapshot_arrays import SnapshotArrays

from .snapshot_store import SnapshotFileError, SnapshotStore, StoredSnapshot

log = logging.getLogger(__name__)

ToArrays = Callable[[Any], SnapshotArrays]
FromArrays = Callable[[SnapshotArrays], Any]
Written = Callable[[StoredSnapshot | None], None]

WRITE_QUEUE = 4  # pending disk writes; beyond this a snapshot stays memory-only


@dataclass(frozen=True)
class _Write:
    key: tuple[int, ...]
    logits: np.ndarray
    snapshot: Any
    note: str
    done: Written  # called with the unattached file, or None when the write failed


class DiskTier:
    """Snapshot files of one store, bounded by ``max_bytes`` (files plus blocks)."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        to_arrays: ToArrays,
        from_arrays: FromArrays,
        max_bytes: int,
        background_writes: bool = True,
    ) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.nbytes = 0  # files plus each block once
        self.errors = 0  # files found corrupt, truncated or foreign, or that the model refused
        self._to_arrays = to_arrays
        self._from_arrays = from_arrays
        self._block_refs: dict[str, list[int]] = {}  # block hash -> [files using it, bytes]
        self._writes: queue.Queue[_Write | None] = queue.Queue(maxsize=WRITE_QUEUE)
        self._writer: threading.Thread | None = None
        if background_writes:
            self._writer = threading.Thread(
                target=self._write_loop, name="prefix-cache-writer", daemon=True
            )
            self._writer.start()

    @property
    def over_budget(self) -> bool:
        return self.nbytes > self.max_bytes

    # -- files and blocks ------------------------------------------------------------

    def index(self) -> list[StoredSnapshot]:
        """Every valid file in the store (headers only), each counted as attached."""
        found = self.store.scan()
        for stored in found:
            self._count(stored)
        return found

    def attach(self, stored: StoredSnapshot) -> bool:
        """Count a freshly written file; False (the file discarded) when a block it found
        on disk while being written has been deleted since."""
        if any(
            d not in self._block_refs and not self.store.block_exists(d) for d in stored.blocks
        ):
            self.discard(stored)
            return False
        self._count(stored)
        return True

    def _count(self, stored: StoredSnapshot) -> None:
        """Account a file, and each of its blocks once across all files."""
        self.nbytes += stored.nbytes
        for digest in stored.blocks:
            ref = self._block_refs.get(digest)
            if ref is not None:
                ref[0] += 1
            else:
                size = self.store.block_nbytes(digest)
                self._block_refs[digest] = [1, size]
                self.nbytes += size

    def drop(self, stored: StoredSnapshot) -> None:
        """Delete an attached file and release its blocks (deleting those now unused)."""
        self.store.delete(stored)
        self.nbytes -= stored.nbytes
        for digest in stored.blocks:
            ref = self._block_refs.get(digest)
            if ref is None:
                continue
            ref[0] -= 1
            if ref[0] == 0:
                del self._block_refs[digest]
                self.store.delete_block(digest)
                self.nbytes -= ref[1]

    def discard(self, stored: StoredSnapshot) -> None:
        """Delete an unattached file and its blocks no attached file uses."""
        self.store.delete(stored)
        for digest in stored.blocks:
            if digest not in self._block_refs:
                self.store.delete_block(digest)

    def load(self, stored: StoredSnapshot) -> tuple[Any, np.ndarray] | None:
        """(snapshot, logits row) read back from an attached file; on any failure the file
        is dropped, counted in ``errors``, and None returned."""
        try:
            loaded = self.store.load(stored)
            snapshot = self._from_arrays(loaded.state)
        except SnapshotFileError:
            pass  # the store logged it and deleted the file itself
        except Exception as exc:  # the model rejected the arrays (shapes, dtypes)
            log.warning("prefix cache: snapshot %s rejected by the model: %s", stored.path, exc)
        else:
            return snapshot, np.asarray(loaded.logits, dtype=np.float32)
        self.errors += 1
        self.drop(stored)
        return None

    # -- writing ---------------------------------------------------------------------

    def write(
        self, key: tuple[int, ...], logits: np.ndarray, snapshot: Any, note: str, done: Written
    ) -> bool:
        """Write ``snapshot`` (on the writer thread when there is one) and hand the
        unattached file, or None, to ``done``. False when the writer is busy: nothing is
        written and ``done`` is never called."""
        item = _Write(key, logits, snapshot, note, done)
        if self._writer is None:
            self._write_one(item)
            return True
        try:
            self._writes.put_nowait(item)
        except queue.Full:
            log.info("prefix cache: disk writer busy; snapshot kept in memory only")
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued write has finished."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write_one(item)
            finally:
                self._writes.task_done()

    def _write_one(self, item: _Write) -> None:
        try:
            stored = self.store.write(
                item.key, item.logits, self._to_arrays(item.snapshot), item.note
            )
        except Exception as exc:  # disk full, permissions, export: stays memory-only
            log.warning("prefix cache: cannot write snapshot: %s", exc)
            stored = None
        item.done(stored)

"""Prefix cache: a radix trie of token paths whose nodes hold model-state snapshots.

A recurrent (KDA) state cannot be rolled back, so a cached prefix is usable only at the
exact position where a snapshot was taken. ``lookup`` returns the deepest snapshot whose
token path is a prefix of the request; the caller evaluates only the remaining tokens.

Each entry stores the logits row of its last position next to the snapshot (about 0.6 MB
at Ling's vocabulary, against ~20 MB of state), so a request whose whole prompt is cached
can sample its first token without re-evaluating anything, and the next token's logits are
the same numbers a cold evaluation produced when the snapshot was taken.

Memory is bounded by bytes. A snapshot type that reports the blocks it shares with other
snapshots (``shared_blocks()``, e.g. the MLA latent prefix) is charged its private part
plus each shared block once across the whole cache; otherwise it is charged ``nbytes``,
everything it references (an upper bound). Eviction is LRU among leaves first: an entry
whose node has children in the trie is a prefix shared by longer conversations (typically
the system and tools header), so it goes only after every leaf below it. With a
``SnapshotStore`` the cache owns a ``DiskTier`` (engine/cache/disk_tier.py) that writes every
snapshot to disk in the background; an entry evicted from memory stays indexed as
disk-only and is read back (and verified) when a request needs it. Which entry stays
where is decided here, by the same LRU order for both budgets.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocols import CacheableSnapshot
from .disk_tier import DiskTier, FromArrays, ToArrays
from .prefix_trie import TrieNode, entries_on_path, insert_node, prune
from .snapshot_store import SnapshotStore, StoredSnapshot


@dataclass(frozen=True)
class CacheHit:
    depth: int  # number of leading request tokens the snapshot covers
    snapshot: CacheableSnapshot
    logits: np.ndarray  # logits row after the snapshot's last token


@dataclass(frozen=True)
class CacheCounters:
    lookups: int
    hits: int
    entries: int
    resident_entries: int
    bytes_held: int  # memory held by resident snapshots and their logits
    disk_entries: int
    disk_bytes: int
    disk_errors: int  # files found corrupt, truncated or foreign and deleted


class _Entry:
    __slots__ = (
        "hits",
        "last_used",
        "logits",
        "nbytes",
        "node",
        "note",
        "snapshot",
        "stored",
        "writing",
    )

    def __init__(self, node: TrieNode) -> None:
        self.node = node
        self.snapshot: CacheableSnapshot | None = None
        self.logits: np.ndarray | None = None
        self.nbytes = 0
        self.stored: StoredSnapshot | None = None
        self.writing = False
        self.last_used = 0
        self.hits = 0
        self.note = ""

    @property
    def resident(self) -> bool:
        return self.snapshot is not None


class PrefixCache:
    """Token-path trie of state snapshots, bounded in memory (and on disk)."""

    def __init__(
        self,
        max_bytes: int,
        *,
        store: SnapshotStore | None = None,
        to_arrays: ToArrays | None = None,
        from_arrays: FromArrays | None = None,
        max_disk_bytes: int | None = None,
        background_writes: bool = True,
    ) -> None:
        if store is not None and (to_arrays is None or from_arrays is None):
            raise ValueError("a snapshot store needs to_arrays and from_arrays")
        self.max_bytes = max_bytes
        self.max_disk_bytes = max_disk_bytes if max_disk_bytes is not None else 4 * max_bytes
        self._lock = threading.RLock()
        self._root = TrieNode((), None, 0)
        self._entries: set[_Entry] = set()
        self._tick = 0
        self._bytes = 0
        # Blocks several snapshots reference (the MLA latent prefix): id -> [refs, block].
        # Holding the block keeps its id from being reused while it is counted.
        self._shared: dict[int, list[Any]] = {}
        self._lookups = 0
        self._hits = 0
        self._disk: DiskTier | None = None
        if store is not None:
            assert to_arrays is not None and from_arrays is not None
            self._disk = DiskTier(
                store,
                to_arrays=to_arrays,
                from_arrays=from_arrays,
                max_bytes=self.max_disk_bytes,
                background_writes=background_writes,
            )
            self._index(self._disk)

    # -- public --------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> CacheHit | None:
        """Deepest usable snapshot whose path is a prefix of ``tokens`` (or None)."""
        with self._lock:
            self._lookups += 1
            for entry in entries_on_path(self._root, tokens):
                if not entry.resident and not self._load(entry):
                    continue
                self._touch(entry)
                entry.hits += 1
                self._hits += 1
                assert entry.logits is not None
                return CacheHit(entry.node.depth, entry.snapshot, entry.logits)
            return None

    def insert(
        self, tokens: Sequence[int], snapshot: CacheableSnapshot, logits: np.ndarray, note: str = ""
    ) -> bool:
        """Remember ``snapshot`` (state after ``tokens``) and its last logits row; ``note``
        is kept with it on disk and handed back by ``notes()`` after a restart.

        Returns False when it cannot be held (bigger than the whole budget)."""
        if not tokens:
            return False
        row = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        if snapshot.private_nbytes + row.nbytes > self.max_bytes:
            return False
        key = tuple(int(t) for t in tokens)
        with self._lock:
            node = insert_node(self._root, key)
            entry = node.entry
            if entry is None:
                entry = node.entry = _Entry(node)
                self._entries.add(entry)
            if not entry.resident:
                self._make_resident(entry, snapshot, row)
            entry.note = note or entry.note
            self._touch(entry)
            self._evict_memory(keep=entry)
            persist = (
                self._disk is not None
                and entry.stored is None
                and not entry.writing
                and entry in self._entries
            )
            if persist:
                entry.writing = True
        if persist:
            self._persist(entry, key, row, snapshot)
        return True

    def counters(self) -> CacheCounters:
        with self._lock:
            disk = self._disk
            return CacheCounters(
                lookups=self._lookups,
                hits=self._hits,
                entries=len(self._entries),
                resident_entries=sum(1 for e in self._entries if e.resident),
                bytes_held=self._bytes,
                disk_entries=sum(1 for e in self._entries if e.stored is not None),
                disk_bytes=disk.nbytes if disk is not None else 0,
                disk_errors=disk.errors if disk is not None else 0,
            )

    def notes(self) -> list[tuple[tuple[int, ...], str]]:
        """(token path, note) of every entry that carries a note."""
        with self._lock:
            return [(e.node.path(), e.note) for e in self._entries if e.note]

    def paths(self) -> list[tuple[int, ...]]:
        """Token paths of every entry (diagnostics and tests)."""
        with self._lock:
            return sorted(e.node.path() for e in self._entries)

    def flush(self) -> None:
        """Wait until every queued disk write has finished."""
        if self._disk is not None:
            self._disk.flush()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread."""
        if self._disk is not None:
            self._disk.close()

    # -- trie ----------------------------------------------------------------------

    def _remove(self, entry: _Entry) -> None:
        """Forget an entry and prune the trie around its node."""
        self._entries.discard(entry)
        self._release(entry)
        entry.node.entry = None
        prune(entry.node)

    # -- memory and disk budgets ------------------------------------------------------

    def _touch(self, entry: _Entry) -> None:
        self._tick += 1
        entry.last_used = self._tick

    def _make_resident(self, entry: _Entry, snapshot: CacheableSnapshot, row: np.ndarray) -> None:
        """Hold ``snapshot`` in memory, charging shared blocks once across all entries."""
        entry.snapshot, entry.logits = snapshot, row
        entry.nbytes = snapshot.private_nbytes + row.nbytes
        self._bytes += entry.nbytes
        for block in snapshot.shared_blocks():
            ref = self._shared.get(id(block))
            if ref is None:
                self._shared[id(block)] = [1, block]
                self._bytes += block.nbytes
            else:
                ref[0] += 1

    def _release(self, entry: _Entry) -> None:
        """Drop an entry's in-memory snapshot (and any shared block nobody else holds)."""
        if entry.snapshot is None:
            return
        for block in entry.snapshot.shared_blocks():
            ref = self._shared[id(block)]
            ref[0] -= 1
            if ref[0] == 0:
                del self._shared[id(block)]
                self._bytes -= block.nbytes
        self._bytes -= entry.nbytes
        entry.snapshot = entry.logits = None

    @staticmethod
    def _eviction_key(entry: _Entry) -> tuple[bool, int]:
        return (bool(entry.node.children), entry.last_used)

    def _evict_memory(self, keep: _Entry) -> None:
        while self._bytes > self.max_bytes:
            candidates = [e for e in self._entries if e.resident and e is not keep]
            if not candidates:
                return
            victim = min(candidates, key=self._eviction_key)
            if victim.stored is not None or victim.writing:
                self._release(victim)  # stays indexed, on disk
            else:
                self._remove(victim)

    def _evict_disk(self) -> None:
        disk = self._disk
        while disk is not None and disk.over_budget:
            candidates = [e for e in self._entries if e.stored is not None]
            if not candidates:
                return
            victim = min(candidates, key=self._eviction_key)
            self._drop_file(victim)
            if not victim.resident:
                self._remove(victim)

    def _drop_file(self, entry: _Entry) -> None:
        """Delete an entry's file (and the blocks only it referenced)."""
        if entry.stored is not None and self._disk is not None:
            self._disk.drop(entry.stored)
            entry.stored = None

    # -- persistence -----------------------------------------------------------------

    def _index(self, disk: DiskTier) -> None:
        """Disk-only entries for every file already in the store."""
        for stored in disk.index():
            node = insert_node(self._root, stored.tokens)
            if node.entry is not None:  # two files for one path: keep one
                disk.drop(stored)
                continue
            entry = node.entry = _Entry(node)
            entry.note = stored.note
            entry.stored = stored
            self._entries.add(entry)
        self._evict_disk()

    def _load(self, entry: _Entry) -> bool:
        """Bring a disk-only entry into memory; on any failure forget it and its file."""
        if entry.stored is None or self._disk is None:
            return False
        loaded = self._disk.load(entry.stored)
        if loaded is None:  # the tier dropped the file
            entry.stored = None
            self._remove(entry)
            return False
        snapshot, logits = loaded
        self._make_resident(entry, snapshot, logits)
        self._evict_memory(keep=entry)
        return True

    def _persist(
        self, entry: _Entry, key: tuple[int, ...], row: np.ndarray, snapshot: CacheableSnapshot
    ) -> None:
        """Hand a snapshot to the disk tier. Snapshots are immutable, so the export to
        arrays happens on the tier's writer thread, off the request path."""
        assert self._disk is not None
        queued = self._disk.write(
            key, row, snapshot, entry.note, lambda stored: self._written(entry, stored)
        )
        if not queued:
            with self._lock:
                entry.writing = False

    def _written(self, entry: _Entry, stored: StoredSnapshot | None) -> None:
        """A write finished: attach the file to its entry if the entry is still held,
        else delete it; an entry left neither in memory nor on disk is forgotten."""
        with self._lock:
            entry.writing = False
            disk = self._disk
            assert disk is not None
            if stored is not None:
                if entry not in self._entries:  # evicted while being written
                    disk.discard(stored)
                    return
                if disk.attach(stored):
                    entry.stored = stored
                    self._evict_disk()
                    return
            if not entry.resident and entry in self._entries:
                self._remove(entry)

"""Snapshot blocks this process has hashed, known by identity and by content hash.

A conversation's successive snapshots hand the disk store the same frozen latent blocks
again and again (model/snapshot_arrays.py), so a block is hashed the first time it is
written, not at every write (at 12K tokens that is the whole 180 MB latent cache per
turn). And a block read back from disk is the very array already in memory when there
is one, so snapshots restored from disk share their blocks with each other and with the
live ones, and the prefix cache charges each block once.

Only immutable arrays are remembered (read-only, owning their bytes or viewing immutable
``bytes``: anything else could change under its hash), and only weakly: a block is known
as long as some snapshot holds it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np


def _immutable(a: np.ndarray) -> bool:
    """True when nothing can write to ``a``'s bytes: read-only all the way down to an
    array that owns them or to a ``bytes`` object."""
    node: object = a
    while isinstance(node, np.ndarray):
        if node.flags.writeable:
            return False
        if node.base is None:
            return True
        node = node.base
    return isinstance(node, bytes)


class KnownBlocks:
    """Weak maps block -> content hash (by identity) and content hash -> block."""

    def __init__(self, hasher: Callable[[np.ndarray], str]) -> None:
        self._hash = hasher
        # Reentrant: a weakref callback runs in whichever thread drops a block's last
        # reference, which may be this one while it holds the lock.
        self._lock = threading.RLock()
        self._by_id: dict[int, tuple[weakref.ref[np.ndarray], str]] = {}
        self._by_digest: weakref.WeakValueDictionary[str, np.ndarray] = (
            weakref.WeakValueDictionary()
        )

    def digest(self, block: np.ndarray) -> str:
        """``block``'s content hash; computed only the first time an immutable block is
        seen."""
        with self._lock:
            known = self._by_id.get(id(block))
        if known is not None and known[0]() is block:
            return known[1]
        digest = self._hash(block)
        self.remember(digest, block)
        return digest

    def array(self, digest: str) -> np.ndarray | None:
        """A live block with this content hash, if this process holds one."""
        with self._lock:
            return self._by_digest.get(digest)

    def remember(self, digest: str, block: np.ndarray) -> None:
        """Know ``block`` (already verified to hash to ``digest``) while it lives."""
        if not _immutable(block):
            return
        key = id(block)

        def forget(ref: weakref.ref[np.ndarray]) -> None:
            with self._lock:
                if self._by_id.get(key, (None, ""))[0] is ref:
                    del self._by_id[key]

        with self._lock:
            self._by_id[key] = (weakref.ref(block, forget), digest)
            if self._by_digest.get(digest) is None:  # the first copy stays the shared one
                self._by_digest[digest] = block

    def __len__(self) -> int:
        """How many blocks are known by identity (tests and diagnostics)."""
        with self._lock:
            return len(self._by_id)

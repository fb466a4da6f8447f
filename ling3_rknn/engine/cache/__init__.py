"""The prefix cache: model-state snapshots kept by token path, in memory and on disk.

Five modules with one job each, kept together because nothing else in the engine needs
their insides: the cache itself (``prefix_cache``: lookup, insertion, the byte budget,
which entry lives where), the radix trie of token paths under it (``prefix_trie``), the
disk tier that writes, counts and reads snapshot files off the request path
(``disk_tier``), the file format of one snapshot (``snapshot_store``), and the blocks the
process has already hashed (``known_blocks``). The engine builds a ``PrefixCache`` (with a
``SnapshotStore`` for ``--cache-dir``) and talks to nothing else here (docs/serving.md 8).
"""

from __future__ import annotations

from .prefix_cache import PrefixCache
from .snapshot_store import SnapshotStore, model_fingerprint

__all__ = ["PrefixCache", "SnapshotStore", "model_fingerprint"]

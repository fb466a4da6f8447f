"""What a state snapshot hands to storage and takes back: the snapshot <-> disk contract.

A per-token (append-only) array, the MLA latent cache, is kept by the state in blocks of
``BLOCK_TOKENS`` rows: a full block is frozen (read-only) and shared by every snapshot
that contains it; only the partly filled last block is private. A snapshot hands such an
array over as ``RowBlocks``, the frozen blocks themselves rather than one joined copy, so
a store can keep each block once (the disk cache names it by content hash) and give the
same blocks back. Every other array is a plain ``np.ndarray``. ``BLOCK_TOKENS`` is
spelled here and nowhere else; the disk format records each block's shape, so the store
never needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

BLOCK_TOKENS = 256


def read_only(block: np.ndarray) -> np.ndarray:
    """``block`` itself when it is already read-only and C-ordered, else a frozen copy:
    a shared block must never change under the snapshots that hold it."""
    if not block.flags.writeable and block.flags.c_contiguous:
        return block
    copy = np.array(block, order="C")
    copy.setflags(write=False)
    return copy


@dataclass(frozen=True)
class RowBlocks:
    """One per-token array as the state holds it: full frozen blocks plus the partial
    last block (fewer than ``BLOCK_TOKENS`` rows, possibly none)."""

    frozen: tuple[np.ndarray, ...]
    partial: np.ndarray

    @property
    def length(self) -> int:
        return sum(len(b) for b in self.frozen) + len(self.partial)

    def rows(self) -> np.ndarray:
        """Every row as one array (a copy)."""
        return np.concatenate([*self.frozen, self.partial], axis=0)

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> RowBlocks:
        """Cut ``rows`` [tokens, width] into frozen blocks (read-only copies) and the rest."""
        full = len(rows) // BLOCK_TOKENS * BLOCK_TOKENS
        frozen = tuple(
            read_only(rows[i : i + BLOCK_TOKENS]) for i in range(0, full, BLOCK_TOKENS)
        )
        return cls(frozen, read_only(rows[full:]))


# A snapshot's arrays by name; per-token ones may come as their blocks.
SnapshotArrays: TypeAlias = Mapping[str, np.ndarray | RowBlocks]


def joined(arrays: SnapshotArrays) -> dict[str, np.ndarray]:
    """One array per name, per-token arrays joined (e.g. for ``np.savez``)."""
    return {
        name: value.rows() if isinstance(value, RowBlocks) else value
        for name, value in arrays.items()
    }

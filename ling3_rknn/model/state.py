"""Per-sequence state and cheap snapshots of it.

A sequence carries, per KDA layer, the recurrent state [H, d, d] and the conv tail (last K-1
pre-conv inputs, [K-1, 3P]); per MLA layer, the latent cache (one row [c_kv | k_rope] per
token). A KDA state cannot be rewound, so the prefix cache keeps snapshots at exact positions.

The latent cache grows without bound, so it is stored in fixed-size blocks: once a block is
full it is frozen (read-only) and shared by every snapshot and every state restored from
one; only the partly filled last block is copied. Appending after a restore writes into a
fresh block, never into one another snapshot references, so branches cannot disturb each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .kda import RecurrentState
from .mla_expanded import PrefillScratch
from .snapshot_arrays import BLOCK_TOKENS, RowBlocks, SnapshotArrays, joined, read_only

# The MLA latent cache is float32, or float16 at half the memory: rows are rounded once when
# appended (relative error <= 2^-11, below what bf16 inference of the checkpoint keeps),
# and attention computes in float32 (docs/model.md 5.2).
LATENT_DTYPES = ("float32", "float16")


def check_latent_dtype(latent_dtype: str) -> None:
    """ValueError for a latent cache dtype the state cannot hold."""
    if latent_dtype not in LATENT_DTYPES:
        raise ValueError(f"latent cache dtype must be one of {LATENT_DTYPES}, got "
                         f"{latent_dtype!r}")


class SnapshotError(ValueError):
    """Snapshot arrays (e.g. from a disk cache) do not fit this model, or a snapshot is from
    another model."""


class StateError(RuntimeError):
    """The state was left inconsistent by a failed forward; restore a snapshot or start anew."""


@dataclass(frozen=True)
class StateLayout:
    """Shapes that make two states interchangeable; derived from the model config."""

    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    recurrent_shape: tuple[int, int, int]
    latent_width: int
    latent_dtype: str = "float32"  # or "float16": half the latent cache (LATENT_DTYPES)

    @classmethod
    def from_config(cls, config: ModelConfig, latent_dtype: str = "float32") -> StateLayout:
        check_latent_dtype(latent_dtype)
        h, d = config.num_attention_heads, config.kda_head_dim
        return cls(
            kda_layers=config.kda_layers,
            mla_layers=config.mla_layers,
            conv_shape=(config.short_conv_kernel_size - 1, 3 * h * d),
            recurrent_shape=(h, d, d),
            latent_width=config.latent_dim,
            latent_dtype=latent_dtype,
        )

    def nbytes(self, tokens: int) -> int:
        """One sequence's state at ``tokens`` positions: the KDA recurrent state (body and
        row scales, float32) and conv tails, and the MLA latent rows (the memory plan's
        per-sequence figure; the recurrence's small rank-1 queue is left out)."""
        h, d, _ = self.recurrent_shape
        kda = (h * d * d + h * d + self.conv_shape[0] * self.conv_shape[1]) * 4
        latent = tokens * self.latent_width * np.dtype(self.latent_dtype).itemsize
        return len(self.kda_layers) * kda + len(self.mla_layers) * latent


class LatentCache:
    """Append-only rows of one MLA layer in frozen shared blocks plus one private tail block."""

    def __init__(
        self,
        width: int,
        frozen: tuple[np.ndarray, ...] = (),
        partial: np.ndarray | None = None,
        dtype: str = "float32",
    ) -> None:
        self.width = width
        self.dtype = np.dtype(dtype)
        self._frozen = frozen
        self._tail = np.empty((BLOCK_TOKENS, width), dtype=self.dtype)
        self._tail_len = 0
        if partial is not None and len(partial):
            self._tail[: len(partial)] = partial
            self._tail_len = len(partial)

    @property
    def length(self) -> int:
        return len(self._frozen) * BLOCK_TOKENS + self._tail_len

    def append(self, rows: np.ndarray) -> None:
        start = 0
        while start < len(rows):
            n = min(BLOCK_TOKENS - self._tail_len, len(rows) - start)
            self._tail[self._tail_len : self._tail_len + n] = rows[start : start + n]
            self._tail_len += n
            start += n
            if self._tail_len == BLOCK_TOKENS:
                self._tail.setflags(write=False)
                self._frozen = (*self._frozen, self._tail)
                self._tail = np.empty((BLOCK_TOKENS, self.width), dtype=self.dtype)
                self._tail_len = 0

    def blocks(self) -> list[np.ndarray]:
        """The cache rows in order, as views (the last one only as long as it is filled)."""
        if self._tail_len:
            return [*self._frozen, self._tail[: self._tail_len]]
        return list(self._frozen)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as one array (a copy)."""
        first, last = start // BLOCK_TOKENS, -(-stop // BLOCK_TOKENS)
        span = np.concatenate(self.blocks()[first:last]) if stop > start else \
            np.empty((0, self.width), self.dtype)
        return span[start - first * BLOCK_TOKENS: stop - first * BLOCK_TOKENS]

    def snapshot(self) -> RowBlocks:
        """The frozen blocks as they are (shared) and a copy of the filled tail rows."""
        partial = self._tail[: self._tail_len].copy()
        partial.setflags(write=False)
        return RowBlocks(self._frozen, partial)


def _latent_key(layer: int) -> str:
    """The name of an MLA layer's latent cache among a snapshot's arrays (and on disk)."""
    return f"mla.{layer}.latent"


class StateSnapshot:
    """An immutable copy of a ``SequenceState`` at ``length`` tokens.

    ``nbytes`` counts every byte the snapshot references (including latent blocks it may share
    with other snapshots: an upper bound for a cache budget); ``private_nbytes`` only what it
    copied for itself (KDA states, conv tails, the partial latent block).
    """

    def __init__(
        self,
        layout: StateLayout,
        length: int,
        conv: Mapping[int, np.ndarray],
        recurrent: Mapping[int, np.ndarray],
        latents: Mapping[int, RowBlocks],
        lineage: object | None = None,
    ) -> None:
        self.layout = layout
        self.length = length
        # The history it was taken from (``SequenceState.restore``); None when read from a
        # store, whose snapshots belong to no live state.
        self._lineage = lineage
        self._conv = dict(conv)
        self._recurrent = dict(recurrent)
        self._latents = dict(latents)
        for a in (*self._conv.values(), *self._recurrent.values()):
            a.setflags(write=False)

    @property
    def private_nbytes(self) -> int:
        own = sum(a.nbytes for a in (*self._conv.values(), *self._recurrent.values()))
        return own + sum(s.partial.nbytes for s in self._latents.values())

    @property
    def nbytes(self) -> int:
        return self.private_nbytes + sum(b.nbytes for b in self.shared_blocks())

    def shared_blocks(self) -> tuple[np.ndarray, ...]:
        """The frozen latent blocks this snapshot may share with others (read-only arrays;
        a cache can charge each one once, keyed by identity)."""
        return tuple(b for s in self._latents.values() for b in s.frozen)

    def blocked_arrays(self) -> dict[str, np.ndarray | RowBlocks]:
        """The arrays for a store (the disk cache): each latent cache as its frozen blocks,
        handed over as they are (not copied), plus its partial block; the KDA states and
        conv tails as copies. ``from_arrays`` reads them back."""
        arrays: dict[str, np.ndarray | RowBlocks] = {
            "length": np.array(self.length, dtype=np.int64)
        }
        for i in self.layout.kda_layers:
            arrays[f"kda.{i}.conv"] = np.array(self._conv[i])
            arrays[f"kda.{i}.recurrent"] = np.array(self._recurrent[i])
        for i in self.layout.mla_layers:
            arrays[_latent_key(i)] = self._latents[i]
        return arrays

    def to_arrays(self) -> dict[str, np.ndarray]:
        """One array per name, each latent cache joined (``np.savez``); ``from_arrays``
        reads them back."""
        return joined(self.blocked_arrays())

    @classmethod
    def from_arrays(cls, config: ModelConfig, arrays: SnapshotArrays,
                    latent_dtype: str = "float32") -> StateSnapshot:
        """Validate untrusted arrays (keys, shapes, dtypes, finiteness) and rebuild a snapshot
        for a state whose latent cache is ``latent_dtype``. A latent cache may come joined
        or as ``RowBlocks``, whose frozen blocks are then kept as they are (shared)."""
        layout = StateLayout.from_config(config, latent_dtype)
        expected: dict[str, tuple[int, ...] | None] = {"length": ()}
        for i in layout.kda_layers:
            expected[f"kda.{i}.conv"] = layout.conv_shape
            expected[f"kda.{i}.recurrent"] = layout.recurrent_shape
        for i in layout.mla_layers:
            expected[_latent_key(i)] = None  # [length, width], checked below
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        if missing or extra:
            raise SnapshotError(
                f"snapshot keys do not match this model: missing {missing}, unexpected {extra}"
            )
        length_arr = np.asarray(arrays["length"])
        if length_arr.shape != () or length_arr.dtype.kind not in "iu" or int(length_arr) < 0:
            raise SnapshotError("snapshot 'length' must be a non-negative integer scalar")
        length = int(length_arr)
        if length > config.max_position_embeddings:
            raise SnapshotError(f"snapshot length {length} exceeds max_position_embeddings")
        for key, shape in expected.items():
            if key != "length" and shape is not None:  # the latent caches: below
                _check_array(key, np.asarray(arrays[key]), "float32", shape)
        conv = {i: np.array(arrays[f"kda.{i}.conv"]) for i in layout.kda_layers}
        recurrent = {i: np.array(arrays[f"kda.{i}.recurrent"]) for i in layout.kda_layers}
        latents = {i: _latent_from(_latent_key(i), arrays[_latent_key(i)], layout, length)
                    for i in layout.mla_layers}
        return cls(layout, length, conv, recurrent, latents)


def _check_array(key: str, a: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    if a.dtype != dtype or a.shape != shape:
        raise SnapshotError(
            f"snapshot array {key!r}: expected {dtype} {list(shape)}, "
            f"got {a.dtype} {list(a.shape)}"
        )
    if not np.isfinite(a).all():
        raise SnapshotError(f"snapshot array {key!r} contains NaN or infinity")


def _latent_from(
    key: str, value: np.ndarray | RowBlocks, layout: StateLayout, length: int
) -> RowBlocks:
    """A checked latent cache of ``length`` rows: joined rows are cut into fresh blocks,
    given blocks are kept (each must be one full block)."""
    width, dtype = layout.latent_width, layout.latent_dtype
    if not isinstance(value, RowBlocks):
        _check_array(key, np.asarray(value), dtype, (length, width))
        cache = LatentCache(width, dtype=dtype)
        cache.append(np.asarray(value))
        return cache.snapshot()
    if value.length != length or len(value.partial) >= BLOCK_TOKENS:
        raise SnapshotError(
            f"snapshot array {key!r}: expected {length} rows in blocks of {BLOCK_TOKENS}, "
            f"got blocks of {[len(b) for b in value.frozen]} + {len(value.partial)} rows"
        )
    for n, block in enumerate(value.frozen):
        _check_array(f"{key}[block {n}]", block, dtype, (BLOCK_TOKENS, width))
    _check_array(f"{key}[partial]", value.partial, dtype, (len(value.partial), width))
    return LatentCache(width, tuple(read_only(b) for b in value.frozen), value.partial,
                       dtype=dtype).snapshot()


class SequenceState:
    """Mutable state of one sequence; ``Model.forward`` advances it."""

    def __init__(self, config: ModelConfig, latent_dtype: str = "float32") -> None:
        self.layout = StateLayout.from_config(config, latent_dtype)
        self.length = 0
        self.conv = {
            i: np.zeros(self.layout.conv_shape, np.float32) for i in self.layout.kda_layers
        }
        self.recurrent = {
            i: RecurrentState.zeros(self.layout.recurrent_shape) for i in self.layout.kda_layers
        }
        self.latents = {i: LatentCache(self.layout.latent_width, dtype=self.layout.latent_dtype)
                        for i in self.layout.mla_layers}
        # MLA rows projected for the expanded prefill form: transient, never in a snapshot
        self.prefill_scratch = PrefillScratch()
        self.broken = False
        # Renewed at every restore: between two restores the history only grows, so a
        # snapshot of the current lineage is a prefix of it and the rows projected so far
        # hold for its positions.
        self._lineage = object()

    def snapshot(self) -> StateSnapshot:
        self.check_usable()
        return StateSnapshot(
            self.layout,
            self.length,
            {i: a.copy() for i, a in self.conv.items()},
            {i: r.value() for i, r in self.recurrent.items()},
            {i: c.snapshot() for i, c in self.latents.items()},
            lineage=self._lineage,
        )

    def restore(self, snapshot: StateSnapshot) -> None:
        """Continue exactly where ``snapshot`` was taken; the snapshot stays untouched.

        A snapshot taken from this state since its last restore (an agent's previous turn)
        keeps the prefill scratch's rows up to its length, so the next prefill does not
        project the prefix again; any other snapshot drops them."""
        if not isinstance(snapshot, StateSnapshot):
            raise TypeError(f"expected a StateSnapshot, got {type(snapshot).__name__}")
        if snapshot.layout != self.layout:
            raise SnapshotError("snapshot was taken from a model with a different layout")
        own = (snapshot._lineage is not None and snapshot._lineage is self._lineage
               and not self.broken and snapshot.length <= self.length)
        self.broken = True  # until every part is restored
        for i in self.layout.kda_layers:
            self.conv[i] = np.array(snapshot._conv[i])
            self.recurrent[i].set(snapshot._recurrent[i])
        for i in self.layout.mla_layers:
            s = snapshot._latents[i]
            self.latents[i] = LatentCache(self.layout.latent_width, s.frozen, s.partial,
                                          dtype=self.layout.latent_dtype)
        self.length = snapshot.length
        if own:
            self.prefill_scratch.truncate(snapshot.length)
        else:
            self.prefill_scratch.release()
        self._lineage = object()
        self.broken = False

    def check_usable(self) -> None:
        if self.broken:
            raise StateError(
                "this state was left half-updated by a failed forward; restore a snapshot "
                "or use a new state"
            )

"""MLA prefill attention in the expanded form: per-head keys and values, 3.4x fewer FLOPs.

The absorbed form (``mla.py``) scores every query against the whole latent row, 16 x (576 +
512) multiply-adds per query-key pair at Ling-3.0-tiny's size. Per head, the scores only see
``W_kb_h c`` and the output only ``W_vb_h ctx``, so with orthonormal bases ``U_h`` of
span(W_kb_h^T) and ``V_h`` of span(W_vb_h^T) (``mla_bases``, [r, d_nope] and [r, d_v]):

    q_lat_h . c  =  (U_h^T q_lat_h) . (U_h^T c)          (q_lat_h = W_kb_h^T q_nope_h)
    W_vb_h ctx_h  =  W_vb_h V_h (V_h^T ctx_h)             (W_vb_h = W_vb_h V_h V_h^T)

Each cached row is projected once into per-head rows [V^T c (d_v) | U^T c (d_nope) | k_rope]
(``ExpandedRows``), and a chunk's queries are scored per head against them: 16 x (192 + 128)
per pair. The context comes back as V_h ctx~ in latent space, so the stage graphs (which
absorb W_kb into the query and apply W_vb after attention) are the same for both forms and
only the CPU glue changes. Exact in exact arithmetic; in float32 within the oracle
tolerance (tests/test_mla_expanded.py).

The projected rows cost memory (per token and MLA layer H x (d_v + d_nope + d_r) values:
5,120 against the latent row's 576 at full size), so they are a prefill scratch: built while
a prompt is evaluated, kept through decode and across a restore to a snapshot of the same
history (an agent's next turn), dropped at any other restore, and only while they fit
``PREFILL_SCRATCH_BYTES``. Where a prefill continues a prefix without rows (a cached prefix
from elsewhere, decoded tokens) those rows must be projected first; ``PrefillScratch.choose``
weighs that against what the absorbed form costs (docs/performance.md, "Prefill budget").
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Protocol

import numpy as np

from . import native
from .memory import return_freed_memory

BLOCK_ROWS = 256
# Dropping at least this much scratch gives the freed pages back (memory.py).
TRIM_AFTER_BYTES = 64 << 20
# The default cap on one sequence's projected rows (all MLA layers, float32): a 16K-token
# prompt of the full-size model needs 2 GiB; longer prompts stay absorbed past it.
PREFILL_SCRATCH_BYTES = 2 << 30


@dataclass(frozen=True)
class MlaBases:
    """Orthonormal bases of one MLA layer's key and value subspaces."""

    key: np.ndarray  # U [H, r, d_nope]
    value: np.ndarray  # V [H, r, d_v]

    @property
    def heads(self) -> int:
        return self.key.shape[0]

    def row_width(self, rope: int) -> int:
        return self.value.shape[2] + self.key.shape[2] + rope


def mla_bases(w_kb: np.ndarray, w_vb: np.ndarray) -> MlaBases:
    """Bases from kv_b_proj's halves W_kb [H, d_nope, r] and W_vb [H, d_v, r] (QR in
    float64). A rank-deficient head still gets a basis spanning at least its subspace."""
    key = np.linalg.qr(np.asarray(w_kb, np.float64).transpose(0, 2, 1))[0]
    value = np.linalg.qr(np.asarray(w_vb, np.float64).transpose(0, 2, 1))[0]
    return MlaBases(key.astype(np.float32), value.astype(np.float32))


class ExpandedRows:
    """One MLA layer's projected rows, per head [v | k_nope | k_rope], in blocks
    [H, BLOCK_ROWS, width] so each head's rows of a block are one C-ordered matrix."""

    def __init__(self, bases: MlaBases, rope: int) -> None:
        self.bases = bases
        self.width = bases.row_width(rope)
        # float32 whatever the latent cache's dtype: a float16 cache's rows are rounded once
        # when cached; rounding their projections again would move prefill off decode
        self.dtype = np.dtype(np.float32)
        self.length = 0
        self._blocks: list[np.ndarray] = []

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._blocks)

    def extend(self, latent_rows: np.ndarray) -> None:
        """Project latent rows [n, r + d_r] and append them."""
        b = self.bases
        h, r, dn = b.key.shape
        dv = b.value.shape[2]
        c = np.asarray(latent_rows[:, :r], np.float32)
        keys = (c @ b.key.transpose(1, 0, 2).reshape(r, h * dn)).reshape(-1, h, dn)
        values = (c @ b.value.transpose(1, 0, 2).reshape(r, h * dv)).reshape(-1, h, dv)
        rope = latent_rows[:, r:]
        done = 0
        while done < len(c):
            off = self.length % BLOCK_ROWS
            if off == 0:
                self._blocks.append(np.empty((h, BLOCK_ROWS, self.width), self.dtype))
            block = self._blocks[-1]
            n = min(BLOCK_ROWS - off, len(c) - done)
            rows = slice(done, done + n)
            block[:, off:off + n, :dv] = values[rows].transpose(1, 0, 2)
            block[:, off:off + n, dv:dv + dn] = keys[rows].transpose(1, 0, 2)
            block[:, off:off + n, dv + dn:] = rope[rows][None]
            done += n
            self.length += n

    def head_blocks(self, head: int) -> list[np.ndarray]:
        return [b[head] for b in self._blocks]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows: the state went back to an earlier point of the
        history these rows were projected from (``SequenceState.restore``)."""
        if length < self.length:
            del self._blocks[-(-length // BLOCK_ROWS):]
            self.length = length

    def free(self) -> None:
        self._blocks.clear()
        self.length = 0


class ProjectedRows(Protocol):
    """One MLA layer's projected rows, wherever they live (CPU float32 blocks here, NPU
    memory in ``mla_npu.NpuRows``). ``truncate`` may keep fewer rows than asked (never
    more): ``length`` says how many, and the caller projects the rest again."""

    bases: MlaBases
    length: int

    @property
    def nbytes(self) -> int: ...

    def extend(self, latent_rows: np.ndarray) -> None: ...

    def truncate(self, length: int) -> None: ...

    def free(self) -> None: ...


class RowStore(Protocol):
    """Where a prefill's projected rows are kept and attended: the CPU kernel's float32
    blocks (``CPU_ROWS``) or the NPU's matmul memory (``mla_npu.NpuAttention``)."""

    def new_rows(self, bases: MlaBases, rope: int) -> ProjectedRows: ...

    def bytes_for(self, bases: MlaBases, rope: int, positions: int) -> int:
        """Bytes ``positions`` cached rows take in one layer, as this store allocates them."""

    def ready(self) -> bool:
        """Whether the expanded form can run on this store now."""


class CpuRowStore:
    """Float32 blocks attended by the compiled prefill kernel (``expanded_attention``)."""

    def new_rows(self, bases: MlaBases, rope: int) -> ExpandedRows:
        return ExpandedRows(bases, rope)

    def bytes_for(self, bases: MlaBases, rope: int, positions: int) -> int:
        return positions * bases.key.shape[0] * bases.row_width(rope) * 4  # float32

    def ready(self) -> bool:
        return native.available()


CPU_ROWS = CpuRowStore()


@dataclass
class PrefillScratch:
    """A sequence's transient prefill state: the projected rows per MLA layer and the
    absorbed-form work spent since the rows were last bought or dropped (the rent paid before
    buying them, as in ski rental: never more than twice the better choice)."""

    rows: dict[int, ProjectedRows] = field(default_factory=dict)
    absorbed_macs: float = 0.0
    store: RowStore | None = None  # where ``rows`` live
    # set when the rows could not be used mid-call (a kernel refused, the NPU failed): the
    # rest of the call runs absorbed, and the rows are dropped when it ends (``release``),
    # not while a second piece in flight may still read them (pipeline.py)
    stale: bool = False

    def clear(self) -> None:
        self._drop_rows()
        self.absorbed_macs = 0.0
        self.stale = False

    def _drop_rows(self) -> None:
        for rows in self.rows.values():
            rows.free()
        self.rows.clear()

    def release(self) -> None:
        """``clear``, handing the pages back to the system when they were many."""
        held = self.nbytes
        self.clear()
        if held >= TRIM_AFTER_BYTES:
            return_freed_memory()

    def truncate(self, length: int) -> None:
        """Keep the rows of the first ``length`` positions (see ``ExpandedRows.truncate``).
        The rent stays: the history goes on, and so does what it paid for the absorbed form
        while it had no rows."""
        held = self.nbytes
        for rows in self.rows.values():
            rows.truncate(length)
        if held - self.nbytes >= TRIM_AFTER_BYTES:
            return_freed_memory()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())

    def choose(self, bases: dict[int, MlaBases], rope: int, length: int, t: int,
               limit: int, store: RowStore = CPU_ROWS) -> bool:
        """Whether this prefill call (``t`` tokens after ``length`` cached rows) runs the
        expanded form: when projecting the rows not yet projected costs no more than what
        the absorbed form has cost since they were last bought or dropped, plus this call,
        and the rows fit ``limit`` bytes. Counted per layer (every MLA layer has the same
        shapes). ``store``: where the rows live (rows of another store are dropped)."""
        if not bases or t < 2 or not store.ready():
            return False
        b = next(iter(bases.values()))
        h, r, dn = b.key.shape
        dv = b.value.shape[2]
        covered = min((rows.length for rows in self.rows.values()), default=0)
        if (len(self.rows) != len(bases) or covered > length or store is not self.store
                or any(self.rows[i].bases is not bases.get(i) for i in self.rows)):
            self._drop_rows()
            covered = 0
        self.store = store
        if store.bytes_for(b, rope, length + t) * len(bases) > limit:
            self.release()
            return False
        projection = (length - covered) * h * (dn + dv) * r
        absorbed = t * h * (2 * r + rope) * (length + t / 2)
        if projection > self.absorbed_macs + absorbed:
            self.absorbed_macs += absorbed
            return False
        for i, layer_bases in bases.items():
            if i not in self.rows:
                self.rows[i] = store.new_rows(layer_bases, rope)
        self.absorbed_macs = 0.0  # the rent bought these rows; later rows start a new one
        return True


def expanded_attention(q_latent: np.ndarray, q_rope: np.ndarray, rows: ExpandedRows,
                       length: int, scale: float, pool: Executor | None = None,
                       parts: int = 1) -> np.ndarray | None:
    """``mla.mla_attention`` for a prefill chunk over ``rows`` (already holding all
    ``length`` rows, the chunk's own included): the same [T, H, r] latent context. The
    heads are shared out over ``pool``'s threads. None when the kernel cannot take it."""
    t_len, h, _ = q_latent.shape
    b = rows.bases
    dv = b.value.shape[2]
    # U_h^T q_lat_h per head as one batched GEMM ([h, t, r] @ [h, r, d]); np.einsum's own
    # loop measured ~10x slower here at the full model's size
    q_small = np.matmul(q_latent.transpose(1, 0, 2), b.key)
    q_cat = np.concatenate([q_small, q_rope.transpose(1, 0, 2)], axis=2) * np.float32(scale)
    first_pos = length - t_len
    q_pos = first_pos + np.arange(t_len, dtype=np.int64)
    calls = []
    for head in range(h):
        call = native.mla_prefill(q_cat[head], q_pos, rows.head_blocks(head), length,
                                  first_pos + 1, dv, score_offset=dv)
        if call is None:
            return None
        calls.append(call)
    shares = _shares(h, parts if pool is not None else 1)
    futures = [pool.submit(_run, calls[a:z]) for a, z in shares[1:]] if pool is not None else []
    _run(calls[shares[0][0]:shares[0][1]])
    for f in futures:
        f.result()
    if any(c.failed for c in calls):
        return None
    ctx_small = np.stack([c.result() for c in calls])  # [H, T, d_v]
    # back to latent space, V_h ctx~_h: [h, t, d_v] @ [h, d_v, r] -> [t, h, r]
    return np.matmul(ctx_small, b.value.transpose(0, 2, 1)).transpose(1, 0, 2)


def _shares(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return list(pairwise(bounds))


def _run(calls: Sequence[native.PrefillAttention]) -> None:
    for call in calls:
        call.run(0, call.tiles)

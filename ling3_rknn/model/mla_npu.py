"""MLA prefill attention in the expanded form with its matmuls on the NPU (docs/model.md 5.5).

The expanded form (``mla_expanded.py``) scores a chunk's queries per head against projected
rows [U^T c | k_rope] and sums projected values V^T c: per head two plain matmuls, which
librknnrt's matmul API runs in float16 with float32 results. Each head's rows are held in
NPU memory, in the matmul's native B layout, in pieces of ``PIECE_ROWS``:

    S = Q_h K_h,p^T        fp16 [M, qk] x [qk, piece] -> fp32 scores   (NPU)
    P = online softmax(S)  running max, denominator, context rescaled  (CPU, attn_softmax.c)
    acc += P V_h,p         fp16 [M, piece] x [piece, dv] -> fp32       (NPU)

Pieces of 2048 rows because P.V with K = cached rows runs at ~574 GFLOPS at 2048 and ~74
past ~4096 on RK3588 (docs/npu-matmul.md). K and N are fixed and M is a dynamic shape
(``QUERY_BUCKETS`` up to the engine's piece; one B serves them all), so one Q.K^T and one
P.V context per NPU core serve every chunk at every depth, a short chunk at a small M; head
h lives on core h % cores, and the cores' heads run on their own threads, so the CPU's
softmax of one head overlaps the others' matmuls.

The projections into and out of each head's small space run there too, as three more fp16
matmuls per layer whose B operands are the layer's bases, written once at load
(``LayerProjections``): a query block's q_h = U_h^T q_lat,h per head, the context back to
the latent V_h ctx~_h per head, and a chunk's rows [U^T c | V^T c] for every head in one
matmul. On the CPU they were ~4 x 2 MFLOP per token and layer, a fifth of the CPU's share of
a prefill (docs/performance.md, "Prefill budget"); on the NPU they cost a few per cent of
its attention time.

Rows are written once when projected (``NpuRows.extend``): the matmul layer packs a region
of B in place, so a chunk writes only its own rows (from the last 32-row boundary, the
alignment both layouts share). The float16 rows take half the bytes of the CPU form's
float32 rows; they are the only copy.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ling3_rknn.config import ModelConfig
from ling3_rknn.npu.matmul import open_runtime, resolve_library
from ling3_rknn.npu.matmul_plan import (
    ALIGN,
    NPU_CORES,
    MatmulB,
    MatmulContext,
    MatmulRuntime,
    MatmulShape,
    check_shape,
    padded,
)

from . import native
from .mla_expanded import MlaBases

log = logging.getLogger(__name__)

# auto: on a board (librknnrt present); on: wherever the matmul runtime opens (the host
# stand-in off a board); off: the CPU kernel
NpuPrefillChoice = Literal["auto", "on", "off"]
NPU_PREFILL_CHOICES: tuple[NpuPrefillChoice, ...] = ("auto", "on", "off")

PIECE_ROWS = 2048
# The engine's prefill piece with the NPU on: the routed experts' int8 matmuls read each
# expert's weights once per piece, so a piece of 1024 tokens (~64 per expert) reads them a
# quarter as often as one of 256, where reading, not arithmetic, bounds them
# (docs/performance.md, "Prefill budget"); attention's Q.K^T was measured at M = 2048.
QUERY_ROWS = 1024
# Smaller M the same contexts also run at (``NpuAttentionShapes.query_buckets``).
QUERY_BUCKETS = (64, 128, 256, 512)
# Rows are rewritten from a multiple of this: K^T's columns come in 16s, V's rows in 32s.
ROW_ALIGN = 32
_LOWEST = np.float32(np.finfo(np.float32).min)


@dataclass(frozen=True)
class NpuAttentionShapes:
    """The two matmuls one MLA layer's heads run, for a model's head sizes."""

    heads: int
    rank: int  # r: the latent rows' width (kv_lora_rank)
    nope: int  # d_nope: a head's key width in the projected space
    rope: int  # d_rope: the rope key, shared by the heads
    dv: int
    query_rows: int = QUERY_ROWS
    piece_rows: int = PIECE_ROWS

    @classmethod
    def of(cls, config: ModelConfig, query_rows: int = QUERY_ROWS,
           piece_rows: int = PIECE_ROWS) -> NpuAttentionShapes:
        """A model's MLA head sizes."""
        return cls(config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim,
                   config.qk_rope_head_dim, config.v_head_dim, query_rows, piece_rows)

    @property
    def qk(self) -> int:
        """One query's / key's width."""
        return self.nope + self.rope

    @property
    def qk_pad(self) -> int:
        return padded(self.qk, ALIGN["fp16"][0])

    @property
    def dv_pad(self) -> int:
        return padded(self.dv, ALIGN["fp16"][1])

    @property
    def rows_width(self) -> int:
        """The rows' projection's columns: every head's keys, then every head's values."""
        return self.heads * (self.nope + self.dv)

    @property
    def query_buckets(self) -> tuple[int, ...]:
        """The M the contexts run at (dynamic shapes, one B for all): a short chunk, a
        later turn of a few hundred tokens, runs at the smallest that holds it."""
        return tuple(sorted({m for m in QUERY_BUCKETS if m < self.query_rows}
                            | {self.query_rows}))

    @property
    def scores(self) -> MatmulShape:
        return MatmulShape(self.query_rows, self.qk_pad, self.piece_rows, "fp16")

    @property
    def context(self) -> MatmulShape:
        return MatmulShape(self.query_rows, self.piece_rows, self.dv_pad, "fp16")

    @property
    def queries(self) -> MatmulShape:
        """q_lat,h [M, r] x U_h [r, d_nope]: a head's queries in its small space."""
        k_align, n_align = ALIGN["fp16"]
        return MatmulShape(self.query_rows, padded(self.rank, k_align),
                           padded(self.nope, n_align), "fp16")

    @property
    def latents(self) -> MatmulShape:
        """ctx~_h [M, d_v] x V_h^T [d_v, r]: a head's context back in the latent space."""
        k_align, n_align = ALIGN["fp16"]
        return MatmulShape(self.query_rows, padded(self.dv, k_align),
                           padded(self.rank, n_align), "fp16")

    @property
    def rows(self) -> MatmulShape:
        """c [M, r] x [U_0 .. U_H-1 | V_0 .. V_H-1]: a chunk's rows for every head."""
        k_align, n_align = ALIGN["fp16"]
        return MatmulShape(self.query_rows, padded(self.rank, k_align),
                           padded(self.rows_width, n_align), "fp16")

    def matmuls(self) -> dict[str, MatmulShape]:
        return {"scores": self.scores, "context": self.context, "queries": self.queries,
                "latents": self.latents, "rows": self.rows}

    def row_bytes(self) -> int:
        """NPU bytes one cached row takes per layer (keys and values, every head)."""
        return self.heads * (self.qk_pad + self.dv_pad) * 2


@dataclass
class AttentionCounters:
    """Where prefill attention's time went, summed over the cores' threads: the matmul runs
    (the NPU, and on a host its stand-in) and the softmax between them (the CPU). Read by
    ``ling3-rknn bench``: on a board, ``softmax_s`` above ``matmul_s`` says the CPU is what
    the NPU waits on."""

    runs: int = 0
    matmul_s: float = 0.0
    softmax_s: float = 0.0

    def add(self, runs: int, matmul_s: float, softmax_s: float) -> None:
        with _COUNTER_LOCK:
            self.runs += runs
            self.matmul_s += matmul_s
            self.softmax_s += softmax_s


_COUNTER_LOCK = threading.Lock()


class LayerProjections:
    """One MLA layer's bases as B operands in NPU memory, written once: per head U_h for its
    queries and V_h^T for its context, on the head's core; [U | V] of every head for the
    rows, on the rows' core. ``nbytes`` counts them for the memory plan."""

    def __init__(self, attention: NpuAttention, bases: MlaBases) -> None:
        s = attention.shapes
        h, r, dn = bases.key.shape
        if (h, r, dn, bases.value.shape[2]) != (s.heads, s.rank, s.nope, s.dv):
            raise ValueError(f"bases [{h}, {r}, {dn}] / d_v {bases.value.shape[2]} do not "
                             f"fit the attention's shapes {s}")
        self.bases = bases
        self.query: list[MatmulB] = []
        self.latent: list[MatmulB] = []
        made: list[MatmulB] = []
        try:
            for head in range(h):
                core = attention.core_of(head)
                q = attention._queries[core].new_b()
                made.append(q)
                attention._queries[core].write_b(q, _whole(bases.key[head], s.queries))
                lat = attention._latents[core].new_b()
                made.append(lat)
                attention._latents[core].write_b(lat, _whole(bases.value[head].T, s.latents))
                self.query.append(q)
                self.latent.append(lat)
            both = np.concatenate([bases.key.transpose(1, 0, 2).reshape(r, h * dn),
                                   bases.value.transpose(1, 0, 2).reshape(r, h * s.dv)], axis=1)
            self.rows = attention._rows.new_b()
            made.append(self.rows)
            attention._rows.write_b(self.rows, _whole(both, s.rows))
        except BaseException:
            for b in made:
                b.free()
            raise
        self._made = made

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._made)

    def free(self) -> None:
        for b in self._made:
            b.free()
        self._made = []


class NpuAttention:
    """The matmul contexts of the prefill attention: per NPU core one context each for the
    scores, the context, the queries' and the context's projections, and one for the rows'
    projection. Built once per model; ``new_rows`` makes a layer's row store on them."""

    def __init__(self, runtime: MatmulRuntime, shapes: NpuAttentionShapes,
                 cores: int = NPU_CORES, domain: int = 0) -> None:
        if shapes.piece_rows % ROW_ALIGN:
            raise ValueError(f"piece rows must be a multiple of {ROW_ALIGN}")
        for shape in shapes.matmuls().values():
            check_shape(shape)
        self.shapes = shapes
        self.runtime = runtime
        self.cores = max(1, min(cores, shapes.heads))
        self._scores: list[MatmulContext] = []
        self._context: list[MatmulContext] = []
        self._queries: list[MatmulContext] = []
        self._latents: list[MatmulContext] = []
        self._rows_ctx: list[MatmulContext] = []
        self._projections: dict[int, LayerProjections] = {}  # by id(bases), bases held
        try:
            rows = shapes.query_buckets if len(shapes.query_buckets) > 1 else ()
            for core in range(self.cores):
                for kind, contexts in (("scores", self._scores), ("context", self._context),
                                       ("queries", self._queries),
                                       ("latents", self._latents)):
                    contexts.append(runtime.context(shapes.matmuls()[kind], core=core,
                                                    domain=domain, rows=rows))
            # the rows' projection runs once per chunk and layer, beside the heads' work
            self._rows_ctx.append(runtime.context(shapes.rows, core=self.cores - 1,
                                                  domain=domain, rows=rows))
        except Exception:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(self.cores, thread_name_prefix="ling3-npu-attn")
        self.counters = AttentionCounters()

    @property
    def _rows(self) -> MatmulContext:
        return self._rows_ctx[0]

    def core_of(self, head: int) -> int:
        return head % self.cores

    def projections(self, bases: MlaBases) -> LayerProjections:
        """The layer's projections in NPU memory, written the first time its bases come."""
        held = self._projections.get(id(bases))
        if held is None or held.bases is not bases:
            held = LayerProjections(self, bases)
            self._projections[id(bases)] = held
        return held

    def prepare(self, bases: Iterable[MlaBases]) -> None:
        """Write every layer's projections now (at load: an NPU that cannot hold them fails
        there, not in a request)."""
        for b in bases:
            self.projections(b)

    def new_rows(self, bases: MlaBases, rope: int) -> NpuRows:
        return NpuRows(self, bases, rope)

    def bytes_for(self, bases: MlaBases, rope: int, positions: int) -> int:
        """Whole pieces: a piece's buffers are allocated when its first row arrives."""
        pieces = -(-positions // self.shapes.piece_rows)
        return pieces * self.shapes.piece_rows * self.shapes.row_bytes()

    def projection_buffers(self) -> int:
        """B operands the layers' projections hold (freed by ``close``)."""
        return sum(len(held._made) for held in self._projections.values())

    def projection_bytes(self) -> int:
        """NPU bytes one layer's projections take (``LayerProjections``)."""
        s = self.shapes
        per_head = s.queries.k * s.queries.n + s.latents.k * s.latents.n
        return 2 * (s.heads * per_head + s.rows.k * s.rows.n)

    def ready(self) -> bool:
        return bool(self._scores)

    def close(self) -> None:
        for held in self._projections.values():
            held.free()
        self._projections.clear()
        for ctx in (*self._scores, *self._context, *self._queries, *self._latents,
                    *self._rows_ctx):
            ctx.close()
        for contexts in (self._scores, self._context, self._queries, self._latents,
                         self._rows_ctx):
            contexts.clear()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    # ----------------------------------------------------------------- attention
    def attend(self, q_latent: np.ndarray, q_rope: np.ndarray, rows: NpuRows, length: int,
               scale: float) -> np.ndarray:
        """``expanded_attention`` on the NPU: the [T, H, r] latent context of a prefill
        chunk's queries over ``rows`` (holding all ``length`` rows, the chunk's own
        included). Raises MatmulError when the NPU fails."""
        t_len, h, r = q_latent.shape
        if rows.length != length:
            raise ValueError(f"rows hold {rows.length} positions, attention wants {length}")
        s = self.shapes
        proj = rows.projections
        first_pos = length - t_len
        out = np.empty((t_len, h, r), np.float32)

        def run_core(core: int) -> None:
            for head in range(core, h, self.cores):
                for q0 in range(0, t_len, s.query_rows):
                    q1 = min(q0 + s.query_rows, t_len)
                    a = _half(q_latent[q0:q1, head], s.queries.k)
                    t0 = time.perf_counter()
                    small = self._queries[core].run(a, proj.query[head])
                    npu_s = time.perf_counter() - t0
                    queries = self._queries_of(small, q_rope[q0:q1, head], scale)
                    ctx = self._attend_head(core, queries, rows.pieces(head), first_pos + q0)
                    a = _half(ctx, s.latents.k)
                    t0 = time.perf_counter()
                    out[q0:q1, head] = self._latents[core].run(a, proj.latent[head])[:, :r]
                    self.counters.add(2, npu_s + time.perf_counter() - t0, 0.0)

        futures = [self._pool.submit(run_core, c) for c in range(1, self.cores)]
        failure: BaseException | None = None
        try:
            run_core(0)
        except BaseException as exc:  # the other cores' matmuls must end first
            failure = exc
        for f in futures:
            try:
                f.result()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return out

    def _queries_of(self, small: np.ndarray, q_rope: np.ndarray, scale: float) -> np.ndarray:
        """One head's scaled float16 queries [n, qk_pad]: [U_h^T q_lat | q_rope] * scale,
        from the NPU's U_h^T q_lat (``small``)."""
        s = self.shapes
        queries = np.zeros((len(small), s.qk_pad), np.float16)
        _to_half(small[:, :s.nope], queries[:, :s.nope], scale)
        _to_half(q_rope, queries[:, s.nope:s.qk], scale)
        return queries

    def _attend_head(self, core: int, q: np.ndarray, pieces: list[tuple[MatmulB, MatmulB]],
                     first_pos: int) -> np.ndarray:
        """One head's queries q [n, qk_pad] (float16, scaled) at positions first_pos.. over
        its pieces: the normalised context [n, dv]."""
        s = self.shapes
        n = len(q)
        # the contexts run at the smallest declared M holding n rows (dynamic shapes)
        visible = first_pos + 1 + np.arange(n, dtype=np.int64)  # keys 0 .. visible-1 seen
        run_max = np.full(n, _LOWEST, np.float32)
        denom = np.zeros(n, np.float32)
        acc = np.zeros((n, s.dv_pad), np.float32)
        p = np.empty((n, s.piece_rows), np.float16)
        last = int(visible[n - 1])
        runs, matmul, softmax = 0, 0.0, 0.0
        clock = time.perf_counter
        for index, (keys, values) in enumerate(pieces):
            start = index * s.piece_rows
            if start >= last:
                break
            t0 = clock()
            scores = self._scores[core].run(q, keys)
            t1 = clock()
            limit = np.clip(visible - start, 0, s.piece_rows).astype(np.int32)
            softmax_piece(scores, limit, run_max, denom, acc, p)
            t2 = clock()
            acc += self._context[core].run(p, values)
            runs, matmul, softmax = runs + 2, matmul + (t1 - t0) + (clock() - t2), softmax + (
                t2 - t1)
        self.counters.add(runs, matmul, softmax)
        return acc[:, :s.dv] / denom[:, None]


def _whole(b: np.ndarray, shape: MatmulShape) -> np.ndarray:
    """``b`` [k', n'] as a whole float16 B [k, n] of ``shape``, zero-padded: a B buffer's
    padding is not zero by itself, and 0 x NaN would still be NaN."""
    out = np.zeros((shape.k, shape.n), np.float16)
    out[:b.shape[0], :b.shape[1]] = b
    return out


def _half(a: np.ndarray, width: int) -> np.ndarray:
    """``a`` [n, w <= width] as a float16 matmul operand [n, width], zero-padded."""
    out = (np.empty if a.shape[1] == width else np.zeros)((len(a), width), np.float16)
    _to_half(a, out[:, :a.shape[1]])
    return out


def _to_half(src: np.ndarray, dst: np.ndarray, scale: float = 1.0) -> None:
    """dst = float16(src * scale) for 2-D views (``attn_softmax.c``; numpy where it
    cannot run)."""
    src = np.asarray(src, np.float32)
    if not native.half_rows(src, dst, scale):
        dst[...] = src * np.float32(scale) if scale != 1.0 else src


def softmax_piece(scores: np.ndarray, limit: np.ndarray, run_max: np.ndarray,
                  denom: np.ndarray, acc: np.ndarray, p: np.ndarray) -> None:
    """One piece of the online softmax (``attn_softmax.c``; numpy where it cannot run).
    Row i sees columns < limit[i]; ``p`` gets float16 exp(score - running max) and the
    denominator sums those rounded values, the ones the NPU multiplies."""
    if native.softmax_piece(scores, limit, run_max, denom, acc, p):
        return
    cols = np.arange(scores.shape[1])
    seen = cols[None, :] < limit[:, None]
    top = np.where(seen, scores, _LOWEST).max(axis=1)
    new_max = np.maximum(run_max, top)
    factor = np.exp(run_max - new_max)  # 0 for a row with no key yet (max -inf-like)
    acc *= factor[:, None]
    denom *= factor
    run_max[:] = new_max
    e = np.where(seen, np.exp(np.minimum(scores - new_max[:, None], 0)), 0).astype(np.float16)
    p[:] = e
    denom += e.astype(np.float32).sum(axis=1)


class NpuRows:
    """One MLA layer's projected rows in NPU memory: per head and piece, K^T [qk_pad,
    piece] for the scores matmul and V [piece, dv_pad] for the context matmul, each in its
    native layout on the head's core. Same interface as ``mla_expanded.ExpandedRows``."""

    def __init__(self, attention: NpuAttention, bases: MlaBases, rope: int) -> None:
        self.bases = bases
        self.projections = attention.projections(bases)
        self._attn = attention
        self._rope = rope
        self.length = 0
        self._pieces: list[list[tuple[MatmulB, MatmulB]]] = []  # [piece][head]
        s = attention.shapes
        h = bases.heads
        # the rows since the last ROW_ALIGN boundary, float16: rewritten with the next ones
        self._tail_keys = np.zeros((0, h, s.qk_pad), np.float16)
        self._tail_values = np.zeros((0, h, s.dv_pad), np.float16)
        # a dropped store gives its NPU memory back (the contexts hold every B they made
        # until they close, so garbage collection alone would not)
        self._finalizer = weakref.finalize(self, _free_pieces, self._pieces)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for piece in self._pieces for k, v in piece)

    def pieces(self, head: int) -> list[tuple[MatmulB, MatmulB]]:
        return [piece[head] for piece in self._pieces]

    def extend(self, latent_rows: np.ndarray) -> None:
        """Project latent rows [n, r + d_r] (positions from ``length`` on) on the NPU, in
        blocks of the contexts' largest M, and write them."""
        if len(latent_rows) == 0:
            return
        s = self._attn.shapes
        h, r, dn, dv = s.heads, s.rank, s.nope, s.dv
        tail = len(self._tail_keys)
        n = tail + len(latent_rows)
        keys16 = np.zeros((n, h, s.qk_pad), np.float16)
        values16 = np.zeros((n, h, s.dv_pad), np.float16)
        keys16[:tail] = self._tail_keys
        values16[:tail] = self._tail_values
        for b0 in range(0, len(latent_rows), s.query_rows):
            block = latent_rows[b0:b0 + s.query_rows]
            t0 = time.perf_counter()
            both = self._attn._rows.run(_half(block[:, :r], s.rows.k), self.projections.rows)
            self._attn.counters.add(1, time.perf_counter() - t0, 0.0)
            rows = slice(tail + b0, tail + b0 + len(block))
            for head in range(h):
                _to_half(both[:, head * dn:(head + 1) * dn], keys16[rows, head, :dn])
                _to_half(block[:, r:], keys16[rows, head, dn:s.qk])
                at = h * dn + head * dv
                _to_half(both[:, at:at + dv], values16[rows, head, :dv])
        start = self.length - tail  # a multiple of ROW_ALIGN
        self._write(start, keys16, values16)
        self.length = start + n
        keep = self.length % ROW_ALIGN
        self._tail_keys = keys16[n - keep:].copy()
        self._tail_values = values16[n - keep:].copy()

    def _write(self, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        attn = self._attn
        s = attn.shapes
        done = 0
        while done < len(keys):
            pos = start + done
            index, offset = divmod(pos, s.piece_rows)
            while len(self._pieces) <= index:
                self._pieces.append(self._new_piece())
            n = min(s.piece_rows - offset, len(keys) - done)
            for head, (kt, v) in enumerate(self._pieces[index]):
                core = attn.core_of(head)
                attn._scores[core].write_b(kt, keys[done:done + n, head].T, row=0, col=offset)
                attn._context[core].write_b(v, values[done:done + n, head], row=offset, col=0)
            done += n

    def _new_piece(self) -> list[tuple[MatmulB, MatmulB]]:
        """A piece's B operands for every head, zeroed (a row not written yet must not be
        NaN: a zero probability times NaN would still be NaN)."""
        attn = self._attn
        s = attn.shapes
        zero_kt = np.zeros((s.qk_pad, s.piece_rows), np.float16)
        zero_v = np.zeros((s.piece_rows, s.dv_pad), np.float16)
        piece: list[tuple[MatmulB, MatmulB]] = []
        made: list[MatmulB] = []
        try:
            for head in range(self.bases.heads):
                core = attn.core_of(head)
                kt = attn._scores[core].new_b()
                made.append(kt)
                v = attn._context[core].new_b()
                made.append(v)
                attn._scores[core].write_b(kt, zero_kt)
                attn._context[core].write_b(v, zero_v)
                piece.append((kt, v))
        except BaseException:
            for b in made:  # the heads' buffers made before the failure
                b.free()
            raise
        return piece

    def truncate(self, length: int) -> None:
        """Keep the rows of the first ``length`` positions, rounded down to ``ROW_ALIGN``:
        the rows after that boundary are projected again from the latent cache with the
        next chunk (their float16 copies are not kept). Rows left in NPU memory past the
        end stay finite and are never seen (limits)."""
        if length >= self.length:
            return
        aligned = length - length % ROW_ALIGN
        keep = -(-aligned // self._attn.shapes.piece_rows)
        for piece in self._pieces[keep:]:
            _free(piece)
        del self._pieces[keep:]
        self.length = aligned
        self._tail_keys = self._tail_keys[:0]
        self._tail_values = self._tail_values[:0]

    def free(self) -> None:
        _free_pieces(self._pieces)
        self.length = 0
        self._tail_keys = self._tail_keys[:0]
        self._tail_values = self._tail_values[:0]


def _free(piece: list[tuple[MatmulB, MatmulB]]) -> None:
    for kt, v in piece:
        kt.free()
        v.free()


def _free_pieces(pieces: list[list[tuple[MatmulB, MatmulB]]]) -> None:
    for piece in pieces:
        _free(piece)
    pieces.clear()



def open_npu_attention(config: ModelConfig, choice: NpuPrefillChoice,
                       runtime: str | None) -> NpuAttention | None:
    """The prefill attention's NPU contexts for a model, or None for the CPU kernel.
    ``runtime``: the matmul library choice (board | mock | None for auto, as the graph
    executors' ``LING3_NPU_RUNTIME``). ``auto`` takes the NPU only where librknnrt is there:
    on a host the stand-in computes what the NPU would, slower than the CPU kernel, so it is
    for tests (``on``), not for serving. Raises MatmulError when ``on`` cannot open it."""
    if choice not in NPU_PREFILL_CHOICES:
        raise ValueError(f"npu prefill must be one of {list(NPU_PREFILL_CHOICES)}, "
                         f"got {choice!r}")
    if choice == "off" or not config.mla_layers:
        return None
    if choice == "auto" and resolve_library(runtime)[0] != "librknnrt":
        return None
    shapes = NpuAttentionShapes.of(config)
    matmul = open_runtime(runtime)
    try:
        attention = NpuAttention(matmul, shapes)
    except BaseException:
        matmul.close()
        raise
    log.info("prefill attention: NPU matmuls on %s (%s x %s, %d-row pieces, %d cores)",
             matmul.name, shapes.scores, shapes.context, shapes.piece_rows, attention.cores)
    return attention

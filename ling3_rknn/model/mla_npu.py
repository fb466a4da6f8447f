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
    qk: int  # d_nope + d_rope: one query's / key's width
    dv: int
    query_rows: int = QUERY_ROWS
    piece_rows: int = PIECE_ROWS

    @property
    def qk_pad(self) -> int:
        return padded(self.qk, ALIGN["fp16"][0])

    @property
    def dv_pad(self) -> int:
        return padded(self.dv, ALIGN["fp16"][1])

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


class NpuAttention:
    """The matmul contexts of the prefill attention: one scores and one context matmul per
    NPU core. Built once per model; ``new_rows`` makes a layer's row store on them."""

    def __init__(self, runtime: MatmulRuntime, shapes: NpuAttentionShapes,
                 cores: int = NPU_CORES, domain: int = 0) -> None:
        if shapes.piece_rows % ROW_ALIGN:
            raise ValueError(f"piece rows must be a multiple of {ROW_ALIGN}")
        check_shape(shapes.scores)
        check_shape(shapes.context)
        self.shapes = shapes
        self.runtime = runtime
        self.cores = max(1, min(cores, shapes.heads))
        self._scores: list[MatmulContext] = []
        self._context: list[MatmulContext] = []
        try:
            rows = shapes.query_buckets if len(shapes.query_buckets) > 1 else ()
            for core in range(self.cores):
                self._scores.append(runtime.context(shapes.scores, core=core, domain=domain,
                                                    rows=rows))
                self._context.append(runtime.context(shapes.context, core=core,
                                                     domain=domain, rows=rows))
        except Exception:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(self.cores, thread_name_prefix="ling3-npu-attn")
        self.counters = AttentionCounters()

    def core_of(self, head: int) -> int:
        return head % self.cores

    def new_rows(self, bases: MlaBases, rope: int) -> NpuRows:
        return NpuRows(self, bases, rope)

    def bytes_for(self, bases: MlaBases, rope: int, positions: int) -> int:
        """Whole pieces: a piece's buffers are allocated when its first row arrives."""
        pieces = -(-positions // self.shapes.piece_rows)
        return pieces * self.shapes.piece_rows * self.shapes.row_bytes()

    def ready(self) -> bool:
        return bool(self._scores)

    def close(self) -> None:
        for ctx in (*self._scores, *self._context):
            ctx.close()
        self._scores.clear()
        self._context.clear()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    # ----------------------------------------------------------------- attention
    def attend(self, q_latent: np.ndarray, q_rope: np.ndarray, rows: NpuRows, length: int,
               scale: float) -> np.ndarray:
        """``expanded_attention`` on the NPU: the [T, H, r] latent context of a prefill
        chunk's queries over ``rows`` (holding all ``length`` rows, the chunk's own
        included). Raises MatmulError when the NPU fails."""
        t_len, h, _ = q_latent.shape
        if rows.length != length:
            raise ValueError(f"rows hold {rows.length} positions, attention wants {length}")
        b = rows.bases
        s = self.shapes
        q_small = np.matmul(q_latent.transpose(1, 0, 2), b.key)  # [H, T, d_nope]
        queries = np.zeros((h, t_len, s.qk_pad), np.float32)
        queries[:, :, :q_small.shape[2]] = q_small
        queries[:, :, q_small.shape[2]:s.qk] = q_rope.transpose(1, 0, 2)
        queries = (queries * np.float32(scale)).astype(np.float16)
        first_pos = length - t_len
        ctx_small = np.empty((h, t_len, s.dv), np.float32)

        def run_core(core: int) -> None:
            for head in range(core, h, self.cores):
                for q0 in range(0, t_len, s.query_rows):
                    q1 = min(q0 + s.query_rows, t_len)
                    ctx_small[head, q0:q1] = self._attend_head(
                        core, queries[head, q0:q1], rows.pieces(head), first_pos + q0)

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
        # back to latent space, V_h ctx~_h: [h, t, d_v] @ [h, d_v, r] -> [t, h, r]
        return np.matmul(ctx_small, b.value.transpose(0, 2, 1)).transpose(1, 0, 2)

    def _attend_head(self, core: int, q: np.ndarray, pieces: list[tuple[MatmulB, MatmulB]],
                     first_pos: int) -> np.ndarray:
        """One head's queries q [n, qk_pad] (float16, scaled) at positions first_pos.. over
        its pieces: the normalised context [n, dv]."""
        s = self.shapes
        n = len(q)
        # the contexts run at the smallest declared M holding n rows (dynamic shapes)
        a = np.ascontiguousarray(q, np.float16)
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
            scores = self._scores[core].run(a, keys)
            t1 = clock()
            limit = np.clip(visible - start, 0, s.piece_rows).astype(np.int32)
            softmax_piece(scores, limit, run_max, denom, acc, p)
            t2 = clock()
            acc += self._context[core].run(p, values)
            runs, matmul, softmax = runs + 2, matmul + (t1 - t0) + (clock() - t2), softmax + (
                t2 - t1)
        self.counters.add(runs, matmul, softmax)
        return acc[:, :s.dv] / denom[:, None]


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
        """Project latent rows [n, r + d_r] (positions from ``length`` on) and write them."""
        if len(latent_rows) == 0:
            return
        s = self._attn.shapes
        b = self.bases
        h, r, dn = b.key.shape
        c = np.asarray(latent_rows[:, :r], np.float32)
        keys = np.zeros((len(c), h, s.qk_pad), np.float32)
        keys[:, :, :dn] = (c @ b.key.transpose(1, 0, 2).reshape(r, h * dn)).reshape(-1, h, dn)
        keys[:, :, dn:s.qk] = latent_rows[:, None, r:]
        values = np.zeros((len(c), h, s.dv_pad), np.float32)
        values[:, :, :s.dv] = (c @ b.value.transpose(1, 0, 2).reshape(r, h * s.dv)
                               ).reshape(-1, h, s.dv)
        keys16 = np.concatenate([self._tail_keys, keys.astype(np.float16)])
        values16 = np.concatenate([self._tail_values, values.astype(np.float16)])
        start = self.length - len(self._tail_keys)  # a multiple of ROW_ALIGN
        self._write(start, keys16, values16)
        self.length = start + len(keys16)
        keep = self.length % ROW_ALIGN
        self._tail_keys = keys16[len(keys16) - keep:].copy()
        self._tail_values = values16[len(values16) - keep:].copy()

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
    shapes = NpuAttentionShapes(config.num_attention_heads,
                                config.qk_nope_head_dim + config.qk_rope_head_dim,
                                config.v_head_dim)
    matmul = open_runtime(runtime)
    try:
        attention = NpuAttention(matmul, shapes)
    except BaseException:
        matmul.close()
        raise
    log.info("prefill attention: NPU matmuls on %s (%s x %s, %d-row pieces, %d cores)",
             matmul.name, shapes.scores, shapes.context, shapes.piece_rows, attention.cores)
    return attention

"""KDA glue that stays on the CPU: the short causal conv and the delta-rule recurrence.

The recurrent state of one layer is S [H, d_k, d_v] (rows = key channels), float32, held in
a ``RecurrentState`` and updated in place. Two algebraically identical forms:
``kda_recurrent`` (one token at a time; the decode hot path) and ``kda_chunked`` (chunks of
64 tokens with a triangular solve per chunk; faster for prefill). ``kda_core`` picks one.
See docs/model.md section 4.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np

from . import native

CHUNK = 64
# The shortest piece that takes the chunked form: in numpy from 16 tokens, with the compiled
# kernel from 4 (at 16 x 128 per layer: 8 tokens 0.47 against 1.2 ms for the recurrence,
# 4 tokens 0.25 against 0.64, 2 tokens even; docs/model.md 4.5).
_MIN_CHUNKED_TOKENS = 16
_MIN_CHUNKED_TOKENS_COMPILED = 4


def short_conv(x: np.ndarray, tail: np.ndarray, taps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU over [T, C] given the previous K-1 inputs ``tail``.

    ``taps`` is [K, C] (tap-major, so every tap is a contiguous row); the last tap multiplies
    the current token. Returns the activated output [T, C] and the new tail (a fresh array).
    """
    t = x.shape[0]
    k = taps.shape[0]
    buf = np.concatenate([tail, x], axis=0)
    if t == 1:  # decode: one [K, C] product and a reduction over the taps
        out = np.einsum("kc,kc->c", buf, taps)[None, :]
    else:
        out = buf[k - 1 :] * taps[k - 1]
        for j in range(k - 1):  # K = 4 taps: each a vectorised [T, C] product
            out += buf[j : j + t] * taps[j]
    return _silu_inplace(out), buf[t:]  # buf is this call's own array: no copy needed


def _silu_inplace(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)) written into ``x``: three passes instead of silu()'s four, which
    shows at T = 1 where the conv output (3 x 2048 channels) is rewritten 18 times a token.
    exp(-x) overflows to inf for x < -88, which still gives the right -0."""
    with np.errstate(over="ignore"):
        y = np.exp(-x)
    y += np.float32(1.0)
    return np.divide(x, y, out=x)


def prepare_qkv(
    conv_out: np.ndarray, num_heads: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the conv output into per-head q (normalised, scaled by d^-1/2), k (normalised), v.

    q and k are normalised in one go (one [T, 2H] set of norms) and q's d^-1/2 is folded
    into its inverse norms: a handful of numpy calls per layer instead of a dozen.
    """
    t = conv_out.shape[0]
    p = num_heads * head_dim
    qk = conv_out[:, : 2 * p].reshape(t, 2 * num_heads, head_dim)
    inv = np.einsum("thd,thd->th", qk, qk)
    inv += np.float32(1e-6)
    np.sqrt(inv, out=inv)
    inv[:, :num_heads] *= np.float32(head_dim**0.5)
    np.reciprocal(inv, out=inv)
    qk = qk * inv[:, :, None]
    v = conv_out[:, 2 * p :].reshape(t, num_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


class KernelBuffers(NamedTuple):
    """A ``RecurrentState``'s arrays as the compiled decode step takes them: S =
    diag(scale) (body + keys^T deltas) with ``pending`` entries of the queue in use."""

    body: np.ndarray  # [H, d_k, d_v]
    scale: np.ndarray  # [H, d_k]
    keys: np.ndarray  # [H, PENDING, d_k]
    deltas: np.ndarray  # [H, PENDING, d_v]
    pending: int


class RecurrentState:
    """One layer's KDA state S [H, d_k, d_v], float32, kept as S = diag(scale) (body + U D).

    Two deferrals keep a decode step to a single pass over the 1 MB body:

    - the per-step decay S <- diag(a) S only multiplies ``scale`` [H, d_k];
    - the rank-1 corrections of the last few tokens are queued as U [H, r, d_k] (keys in
      body coordinates) and D [H, r, d_v] (deltas) and applied together as one rank-r
      product every ``PENDING`` tokens. Reads add the queued part through two tiny products.

    A per-token in-place rank-1 update costs a full read-modify-write of the body plus a
    temporary (~2.5x the reads' memory traffic); batching r of them moves that to one
    pass per r tokens (measured in tests/bench/bench_cpu_glue.py). Per row the scaling is
    uniform, so float32 rounding is that of the direct form; the scale is folded back into
    the body before it could leave the comfortable float32 range.
    """

    FOLD_BELOW = 1e-15
    FOLD_ROWS_BELOW = 1e-4  # rows folded together once any row reaches FOLD_BELOW
    PENDING = 16

    def __init__(self, body: np.ndarray) -> None:
        self.body = body
        self.scale = np.ones(body.shape[:2], dtype=np.float32)
        self._unit = True  # scale is exactly 1: value() and fold() are free
        h, dk, dv = body.shape
        self._keys = np.empty((h, self.PENDING, dk), dtype=np.float32)
        self._deltas = np.empty((h, self.PENDING, dv), dtype=np.float32)
        self._pending = 0
        self._reads_in = np.empty((h, 2, dk), dtype=np.float32)  # [c k, c q] per head

    @classmethod
    def zeros(cls, shape: tuple[int, int, int]) -> RecurrentState:
        return cls(np.zeros(shape, dtype=np.float32))

    def kernel_buffers(self) -> KernelBuffers:
        """The arrays a compiled decode step (``kda_decode.c``) reads and updates in place,
        in the deferred form above. After the kernel has run, ``kernel_step_done`` records
        what it did, so the state's own bookkeeping stays here."""
        return KernelBuffers(self.body, self.scale, self._keys, self._deltas, self._pending)

    def kernel_step_done(self) -> None:
        """A compiled step decayed the row scales and queued one correction into the
        buffers of ``kernel_buffers``: count it, and flush a full queue."""
        self._unit = False
        self._pending += 1
        if self._pending == self.PENDING:
            self.flush()

    def decay(self, factor: np.ndarray) -> None:
        """S <- diag(factor) S for factor [H, d_k]: only the row scales change; rows that
        decayed below ``FOLD_BELOW`` are folded into the body."""
        scale = self.scale
        scale *= factor
        self._unit = False
        if scale.min() < self.FOLD_BELOW:
            self.fold_small_rows()

    @property
    def pending(self) -> int:
        """Corrections queued and not yet applied to the body."""
        return self._pending

    def flush(self) -> None:
        """Apply the queued rank-r correction to the body (in place)."""
        p = self._pending
        if p:
            self.body += np.matmul(
                self._keys[:, :p].transpose(0, 2, 1), self._deltas[:, :p]
            )
            self._pending = 0

    def fold(self) -> None:
        """Apply the queued corrections and the pending scale to the body (in place)."""
        self.flush()
        if not self._unit:
            self.body *= self.scale[:, :, None]
            self.scale.fill(1.0)
            self._unit = True

    def fold_small_rows(self) -> None:
        """Fold the scale of the strongly decayed rows only (S is diag(scale) B row by row).

        Rows with mild decay never get near the threshold, so this usually touches a few
        rows (gathered by index) instead of the whole body; when most rows decay fast, one
        in-place pass with a factor of 1 on the other rows is cheaper than the gather. The
        queued keys are body coordinates of the same rows and are rescaled with them.
        """
        small = self.scale < self.FOLD_ROWS_BELOW
        p = self._pending
        if np.count_nonzero(small) * 8 > small.size:
            factor = np.where(small, self.scale, np.float32(1.0))
            self.body *= factor[:, :, None]
            self._keys[:, :p] *= factor[:, None, :]
            np.copyto(self.scale, np.float32(1.0), where=small)  # a scale may be exactly 0
            return
        rows = np.nonzero(small)
        factor = self.scale[rows][:, None]
        self.body[rows] *= factor
        if p:
            self._keys[rows[0], :p, rows[1]] *= factor
        self.scale[rows] = 1.0

    def value(self) -> np.ndarray:
        """S as a new array (what a snapshot stores)."""
        self.flush()
        if self._unit:
            return self.body.copy()
        return self.body * self.scale[:, :, None]

    def set(self, value: np.ndarray) -> None:
        self.body = np.array(value, dtype=np.float32)
        self.scale.fill(1.0)
        self._unit = True
        self._pending = 0

    def read_and_queue(
        self, k: np.ndarray, q: np.ndarray, v: np.ndarray, beta: np.ndarray, qk: np.ndarray
    ) -> np.ndarray:
        """One delta-rule token on the already-decayed state: returns S_new^T q [H, d_v].

        With S = diag(c) B: e = B^T (c k), S_new^T q = B^T (c q) + (q.k) delta, and the
        correction B += (k / c) delta^T is queued; both reads share one batched product.
        """
        scale = self.scale
        x = self._reads_in  # [H, 2, d_k]
        np.multiply(k, scale, out=x[:, 0])
        np.multiply(q, scale, out=x[:, 1])
        reads = np.matmul(x, self.body)  # [H, 2, d_v]
        p = self._pending
        if p:
            keys, deltas = self._keys[:, :p], self._deltas[:, :p]
            reads += np.matmul(np.matmul(x, keys.transpose(0, 2, 1)), deltas)
        delta = self._deltas[:, p]
        np.subtract(v, reads[:, 0], out=delta)
        delta *= beta[:, None]
        np.divide(k, scale, out=self._keys[:, p])
        self._pending = p + 1
        out = reads[:, 1]
        out += qk * delta
        if self._pending == self.PENDING:
            self.flush()
        return out


def kda_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray,
                  beta: np.ndarray, state: RecurrentState) -> np.ndarray:
    """Per-token delta rule, updating ``state`` in place. Returns [T, H, d_v].

    decay S <- diag(a) S; predict e = S^T k; correct S += k (beta (v - e))^T; read S^T q.
    The decay goes into the state's row scale, the read and the queued correction into
    ``RecurrentState.read_and_queue``.
    """
    t_len = q.shape[0]
    body_shape = state.body.shape
    out = np.empty((t_len, body_shape[0], body_shape[2]), dtype=np.float32)
    decay = np.exp(log_decay)
    qk_dot = np.einsum("thd,thd->th", q, k)[:, :, None]  # [T, H, 1]
    for t in range(t_len):
        state.decay(decay[t])
        out[t] = state.read_and_queue(k[t], q[t], v[t], beta[t], qk_dot[t])
    return out


def kda_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    recurrent: RecurrentState,
    chunk: int = CHUNK,
    pool: Executor | None = None,
    parts: int = 1,
) -> np.ndarray:
    """The chunked (WY) form of ``kda_recurrent``; same result, same in-place state update.

    Per chunk with in-chunk cumulative log decay G: solve (I + beta K Kdecay^T) for the
    corrected values, then read the output and roll the state forward once per chunk.
    Runs in the compiled kernel (``kda_chunk.c``) when it is available and takes the
    shapes, else in numpy (the reference the kernel is tested against). Heads are
    independent, so with a ``pool`` they are split into ``parts`` ranges computed at the
    same time.
    """
    t_len, h, _ = k.shape
    recurrent.fold()
    body = recurrent.body
    def plain(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    # the contiguous copies only where the kernel takes the width (numpy reads the views)
    call = (native.kda_chunk_call(plain(q), plain(k), plain(v), plain(log_decay), plain(beta),
                                  body, chunk)
            if native.kda_chunk_takes(k.shape[2], chunk) else None)
    if call is not None:
        # the kernel refuses a shape before touching anything, the same for every share
        _over_heads(call.run, h, pool, parts)
        if not call.failed:
            return call.out
    out = np.empty((t_len, h, v.shape[2]), dtype=np.float32)
    _over_heads(lambda a, b: _chunked_heads(q[:, a:b], k[:, a:b], v[:, a:b],
                                            log_decay[:, a:b], beta[:, a:b], body[a:b],
                                            out[:, a:b], chunk), h, pool, parts)
    return out


def _over_heads(run: Callable[[int, int], object], heads: int, pool: Executor | None,
                parts: int) -> None:
    """``run(a, b)`` for ranges of heads covering [0, heads): ``parts`` ranges at the same
    time with a ``pool`` (the kernels and numpy release the GIL), else one call."""
    if pool is None or parts < 2 or heads < 2:
        run(0, heads)
        return
    bounds = np.linspace(0, heads, min(parts, heads) + 1).astype(int).tolist()
    futures = [pool.submit(run, a, b) for a, b in itertools.pairwise(bounds[1:])]
    run(bounds[0], bounds[1])
    for f in futures:
        f.result()


def _chunked_heads(q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray,
                   beta: np.ndarray, state: np.ndarray, out: np.ndarray, chunk: int) -> None:
    """``kda_chunked`` for a range of heads: ``state`` [h, d_k, d_v] and ``out`` [T, h, d_v]
    are (views of) the caller's arrays, written in place."""
    t_len = k.shape[0]
    for start in range(0, t_len, chunk):
        end = min(start + chunk, t_len)
        c = end - start
        qc = q[start:end].transpose(1, 0, 2)  # [H, C, d_k]
        kc = k[start:end].transpose(1, 0, 2)
        vc = v[start:end].transpose(1, 0, 2)  # [H, C, d_v]
        bc = beta[start:end].T[:, :, None]  # [H, C, 1]
        g = np.cumsum(log_decay[start:end].transpose(1, 0, 2), axis=1)  # [H, C, d_k]
        kk, qk = _decayed_products(qc, kc, g)
        strict = np.tril(kk, -1) * bc  # beta_r * <k_r, k_s>_decay for s < r
        system = strict + np.eye(c, dtype=np.float32)
        exp_g = np.exp(g)
        rhs = np.concatenate([bc * vc, bc * kc * exp_g], axis=2)
        sol = np.linalg.solve(system, rhs)
        u, w = sol[:, :, : vc.shape[2]], sol[:, :, vc.shape[2] :]
        v_new = u - w @ state  # [H, C, d_v]
        out[start:end] = ((qc * exp_g) @ state + qk @ v_new).transpose(1, 0, 2)
        g_last = g[:, -1:, :]  # [H, 1, d_k]
        state *= np.exp(g_last).transpose(0, 2, 1)
        state += (kc * np.exp(g_last - g)).transpose(0, 2, 1) @ v_new


_SUB = 16  # rows per sub-block of a chunk in ``_decayed_products``


def _decayed_products(qc: np.ndarray, kc: np.ndarray, g: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """kk[r, s] = sum_i k_ri k_si exp(G_ri - G_si) and the same with q_r, for s <= r
    (zero above the diagonal); [H, C, C] each.

    Forming every exp(G_r - G_s) costs a [H, C, C, d_k] tensor (8M exps per 64-token chunk
    at 16 x 128). Only pairs inside one ``_SUB``-row diagonal block are formed that way; a
    pair of rows r > b >= s across blocks factors through the last row b of s's block,
    exp(G_r - G_b) exp(G_b - G_s), two factors <= 1 (G falls along the chunk, so nothing
    overflows; an underflowing factor means an even smaller product) and one batched
    product per block. Measured 4.5x faster at C = 64, d_k = 128 on this host.
    """
    h, c, _ = kc.shape
    kk = np.zeros((h, c, c), dtype=np.float32)
    qk = np.zeros((h, c, c), dtype=np.float32)
    for s0 in range(0, c, _SUB):
        s1 = min(s0 + _SUB, c)
        n = s1 - s0
        gs, ks, qs = g[:, s0:s1], kc[:, s0:s1], qc[:, s0:s1]
        lower = np.tril(np.ones((n, n), dtype=bool))[None, :, :, None]
        diff = gs[:, :, None, :] - gs[:, None, :, :]  # [H, r, s, d_k], r, s in the block
        decay = np.exp(np.where(lower, diff, -np.inf)).astype(np.float32)
        decay *= ks[:, None, :, :]
        kk[:, s0:s1, s0:s1] = np.einsum("hrsi,hri->hrs", decay, ks)
        qk[:, s0:s1, s0:s1] = np.einsum("hrsi,hri->hrs", decay, qs)
        if s1 < c:
            g_ref = g[:, s1 - 1 : s1]  # [H, 1, d_k]: the block's last row
            keys = (ks * np.exp(g_ref - gs)).transpose(0, 2, 1)  # [H, d_k, n]
            later = np.exp(g[:, s1:] - g_ref)  # [H, C - s1, d_k]
            kk[:, s1:, s0:s1] = (kc[:, s1:] * later) @ keys
            qk[:, s1:, s0:s1] = (qc[:, s1:] * later) @ keys
    return kk, qk


def kda_decode(qkv: np.ndarray, tail: np.ndarray, taps: np.ndarray, log_decay: np.ndarray,
               beta: np.ndarray, state: RecurrentState, pool: Executor | None = None,
               parts: int = 1) -> np.ndarray | None:
    """One decode token of a KDA layer through the compiled kernel: ``short_conv`` (the
    ``tail`` updated in place), ``prepare_qkv`` and ``kda_recurrent`` in one call per share
    of the heads. Returns [1, H, d_v], or None (nothing touched) when the kernel is not
    available; the numpy functions are the reference it is tested against."""
    buffers = state.kernel_buffers()
    call = native.kda_decode_call(
        qkv[0], tail, taps, log_decay[0], beta[0], buffers.body, buffers.scale, buffers.keys,
        buffers.deltas, buffers.pending, RecurrentState.FOLD_BELOW,
        RecurrentState.FOLD_ROWS_BELOW)
    if call is None:
        return None
    _over_heads(call.run, call.heads, pool, parts)
    state.kernel_step_done()
    return call.out[None]


def kda_core(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    state: RecurrentState,
    pool: Executor | None = None,
    parts: int = 1,
) -> np.ndarray:
    """Chunked form for prefill pieces (heads split over ``pool`` when given), plain
    recurrence for decode and short pieces."""
    compiled = native.kda_chunk_takes(k.shape[2], CHUNK)
    shortest = _MIN_CHUNKED_TOKENS_COMPILED if compiled else _MIN_CHUNKED_TOKENS
    if q.shape[0] >= shortest:
        return kda_chunked(q, k, v, log_decay, beta, state, pool=pool, parts=parts)
    return kda_recurrent(q, k, v, log_decay, beta, state)

"""KDA glue that stays on the CPU: the short causal conv and the delta-rule recurrence.

The recurrent state of one layer is S [H, d_k, d_v] (rows = key channels), float32, held in
a ``RecurrentState`` and updated in place. Two algebraically identical forms:
``kda_recurrent`` (one token at a time; the decode hot path) and ``kda_chunked`` (chunks of
64 tokens with a triangular solve per chunk; faster for prefill). ``kda_core`` picks one.
See ling3-model.md section 3.3.
"""

from __future__ import annotations

import numpy as np

from .stages import silu

CHUNK = 64
_MIN_CHUNKED_TOKENS = 16


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
    return silu(out), buf[t:].copy()


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6), the fla / transformers form (eps inside the root)."""
    sq = np.einsum("...d,...d->...", x, x)[..., None]
    return x / np.sqrt(sq + np.float32(1e-6))


def prepare_qkv(
    conv_out: np.ndarray, num_heads: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the conv output into per-head q (normalised, scaled by d^-1/2), k (normalised), v."""
    t = conv_out.shape[0]
    p = num_heads * head_dim
    q = conv_out[:, :p].reshape(t, num_heads, head_dim)
    k = conv_out[:, p : 2 * p].reshape(t, num_heads, head_dim)
    v = conv_out[:, 2 * p :].reshape(t, num_heads, head_dim)
    return l2_normalize(q) * np.float32(head_dim**-0.5), l2_normalize(k), v


class RecurrentState:
    """One layer's KDA state S [H, d_k, d_v], float32, kept as S = diag(scale) @ body per head.

    The per-step decay S <- diag(a) S only multiplies ``scale`` [H, d_k]; the body is touched
    once per step, by the rank-1 correction. That saves a full pass over the state per token
    (the decode step is memory-bound: ~17% faster measured here). Per row the scaling is
    uniform, so float32 rounding is that of the direct form; the scale is folded back into
    the body before it could leave the comfortable float32 range.
    """

    FOLD_BELOW = 1e-15

    def __init__(self, body: np.ndarray) -> None:
        self.body = body
        self.scale = np.ones(body.shape[:2], dtype=np.float32)
        self._unit = True  # scale is exactly 1: value() and fold() are free

    @classmethod
    def zeros(cls, shape: tuple[int, int, int]) -> RecurrentState:
        return cls(np.zeros(shape, dtype=np.float32))

    def fold(self) -> None:
        """Apply the pending scale to the body (in place)."""
        if not self._unit:
            self.body *= self.scale[:, :, None]
            self.scale.fill(1.0)
            self._unit = True

    def value(self) -> np.ndarray:
        """S as a new array (what a snapshot stores)."""
        if self._unit:
            return self.body.copy()
        return self.body * self.scale[:, :, None]

    def set(self, value: np.ndarray) -> None:
        self.body = np.array(value, dtype=np.float32)
        self.scale.fill(1.0)
        self._unit = True


def kda_recurrent(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    state: RecurrentState,
) -> np.ndarray:
    """Per-token delta rule, updating ``state`` in place. Returns [T, H, d_v].

    decay S <- diag(a) S; predict e = S^T k; correct S += k (beta (v - e))^T; read S^T q.
    With S = diag(c) B and c' = c a: e = B^T (c' k), S_new^T q = B^T (c' q) + (q.k) delta,
    and the correction is B += (k / c') delta^T; both reads come from one batched product
    over the old body, so the body is read once and updated once per token.
    """
    t_len = q.shape[0]
    body_shape = state.body.shape
    out = np.empty((t_len, body_shape[0], body_shape[2]), dtype=np.float32)
    decay = np.exp(log_decay)
    qk_dot = np.sum(q * k, axis=2, keepdims=True)  # [T, H, 1]
    for t in range(t_len):
        kt = k[t]
        scale = state.scale
        scale *= decay[t]
        state._unit = False
        if scale.min() < RecurrentState.FOLD_BELOW:
            state.fold()
            scale = state.scale
        body = state.body
        reads = np.matmul(np.stack([kt * scale, q[t] * scale], axis=1), body)  # [H, 2, d_v]
        delta = (v[t] - reads[:, 0]) * beta[t][:, None]
        out[t] = reads[:, 1] + qk_dot[t] * delta
        body += (kt / scale)[:, :, None] * delta[:, None, :]
    return out


def kda_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    recurrent: RecurrentState,
    chunk: int = CHUNK,
) -> np.ndarray:
    """The chunked (WY) form of ``kda_recurrent``; same result, same in-place state update.

    Per chunk with in-chunk cumulative log decay G: solve (I + beta K Kdecay^T) for the
    corrected values, then read the output and roll the state forward once per chunk.
    Decay factors are always formed as exp(G_r - G_s) with G_r <= G_s, so nothing overflows.
    """
    t_len, h, _ = k.shape
    out = np.empty((t_len, h, v.shape[2]), dtype=np.float32)
    recurrent.fold()
    state = recurrent.body
    for start in range(0, t_len, chunk):
        end = min(start + chunk, t_len)
        c = end - start
        qc = q[start:end].transpose(1, 0, 2)  # [H, C, d_k]
        kc = k[start:end].transpose(1, 0, 2)
        vc = v[start:end].transpose(1, 0, 2)  # [H, C, d_v]
        bc = beta[start:end].T[:, :, None]  # [H, C, 1]
        g = np.cumsum(log_decay[start:end].transpose(1, 0, 2), axis=1)  # [H, C, d_k]
        lower = np.tril(np.ones((c, c), dtype=bool))
        diff = g[:, :, None, :] - g[:, None, :, :]  # [H, C(r), C(s), d_k]
        decay = np.exp(np.where(lower[None, :, :, None], diff, -np.inf)).astype(np.float32)
        kk = np.einsum("hri,hsi,hrsi->hrs", kc, kc, decay, optimize=True)
        qk = np.einsum("hri,hsi,hrsi->hrs", qc, kc, decay, optimize=True)
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
    return out


def kda_core(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    state: RecurrentState,
) -> np.ndarray:
    """Chunked form for prefill pieces, plain recurrence for decode and short pieces."""
    if q.shape[0] >= _MIN_CHUNKED_TOKENS:
        return kda_chunked(q, k, v, log_decay, beta, state)
    return kda_recurrent(q, k, v, log_decay, beta, state)

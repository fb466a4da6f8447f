"""KDA glue that stays on the CPU: the short causal conv and the delta-rule recurrence.

The recurrent state of one layer is S [H, d_k, d_v] (rows = key channels), float32, updated
in place. Two algebraically identical forms: ``kda_recurrent`` (one token at a time; the
decode hot path) and ``kda_chunked`` (chunks of 64 tokens with a triangular solve per chunk;
faster for prefill). ``kda_core`` picks one. See ling3-model.md section 3.3.
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


def kda_recurrent(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
) -> np.ndarray:
    """Per-token delta rule; ``state`` [H, d_k, d_v] is updated in place. Returns [T, H, d_v].

    decay S <- diag(a) S; predict e = S^T k; correct S += k (beta (v - e))^T; read S^T q.
    Both reads are taken from the *old* state in one batched product, using
    e = S_old^T (a*k) and S_new^T q = S_old^T (a*q) + (q.k) delta, so the state (1 MB per
    layer at the real size; the decode hot path is memory-bound) is not read a third time
    after the update: measured ~20% faster than the literal order.
    """
    t_len = q.shape[0]
    out = np.empty((t_len, state.shape[0], state.shape[2]), dtype=np.float32)
    decay = np.exp(log_decay)
    qk_dot = np.sum(q * k, axis=2, keepdims=True)  # [T, H, 1]
    for t in range(t_len):
        a, kt = decay[t], k[t]
        reads = np.matmul(np.stack([kt * a, q[t] * a], axis=1), state)  # [H, 2, d_v]
        delta = (v[t] - reads[:, 0]) * beta[t][:, None]
        out[t] = reads[:, 1] + qk_dot[t] * delta
        state *= a[:, :, None]
        state += kt[:, :, None] * delta[:, None, :]
    return out


def kda_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    chunk: int = CHUNK,
) -> np.ndarray:
    """The chunked (WY) form of ``kda_recurrent``; same result, same in-place state update.

    Per chunk with in-chunk cumulative log decay G: solve (I + beta K Kdecay^T) for the
    corrected values, then read the output and roll the state forward once per chunk.
    Decay factors are always formed as exp(G_r - G_s) with G_r <= G_s, so nothing overflows.
    """
    t_len, h, _ = k.shape
    out = np.empty((t_len, h, v.shape[2]), dtype=np.float32)
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
    state: np.ndarray,
) -> np.ndarray:
    """Chunked form for prefill pieces, plain recurrence for decode and short pieces."""
    if q.shape[0] >= _MIN_CHUNKED_TOKENS:
        return kda_chunked(q, k, v, log_decay, beta, state)
    return kda_recurrent(q, k, v, log_decay, beta, state)

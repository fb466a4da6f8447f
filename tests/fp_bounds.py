"""Error bounds for the numerics tests, derived from the arithmetic instead of tuned on a host.

Two evaluations of the same float32 computation (a compiled kernel and numpy, two piece
splits, two vector widths) differ by their rounding, and the rounding is bounded by the
unit roundoff times the accumulation length times the size of what was added up. Each
bound below says which of those it counts; docs/performance.md ("Tolerances") has the rules.

- A rounding moves a value by at most u relative: u = 2^-24 in float32, 2^-11 in float16.
- A sum of n products, rounded in any order, is within gamma(n) * sum|a_i b_i| of the exact
  one. Worst case gamma is n u; for data without structure the rounding errors are
  independent with mean zero and gamma(n) = lam sqrt(n) u holds with probability at least
  1 - 2 n exp(-lam^2 / 2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, thm. 3.1 and
  sec. 4): lam = 8 gives 1 - 3e-14 n, so a test cannot fail by chance, and the bound is
  sqrt(n)/8 times tighter than n u at the lengths here (n ~ 600 to 50,000). The tests'
  data is random (seeded), which is what the model assumes.
- FMA contraction (the kernels are built with -ffp-contract=fast, native_build.py; OpenBLAS
  uses FMA on AVX2, AVX-512 and NEON) leaves a product unrounded before its addition:
  one rounding per term instead of two. The bounds count n for a sum of n products, which
  covers both, so they hold for every ISA path whether or not it contracts.
- Converting float16 to float32 is exact (F16C, NEON's fcvtl, numpy alike): a float16 cache
  read by both sides adds nothing; rounding a float32 value to float16 moves it by up to
  2^-11 relative.
- Two evaluations each within E of the exact result are within 2 E of each other.
"""

from __future__ import annotations

import math

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff
U16 = 2.0**-11  # float16 unit roundoff: one rounding to float16, relative
LAMBDA = 8.0  # the probabilistic bound's confidence (see above)
EXP_ULPS = 4  # e^x in float32: numpy's SIMD expf and the kernels' Cephes form are within
# 4 ulp (Cephes: 1e-7 relative, ~1.7 u; numpy's AVX-512 expf: under 2.6 ulp); 1 ulp <= 2u
EXP_REL = EXP_ULPS * 2 * U32


def gamma(n: int | float) -> float:
    """The relative error of a float32 sum of ``n`` rounded terms (probabilistic, lam = 8)."""
    return LAMBDA * math.sqrt(max(n, 1)) * U32


def attention_error(q: np.ndarray, rows: np.ndarray, r: int, scale: float,
                    group: int = 64) -> float:
    """The largest error of one float32 evaluation of softmax(scale q rows^T) rows[:, :r]
    (an MLA context), absolute, for queries ``q`` [m, d] over ``rows`` [n, >= d] (rows a
    query cannot see only loosen it).

    Score: a d-term sum plus the scale and the max subtraction, gamma(d + 2) times
    S = scale max sum|q||k|. A weight: e^(score error) and e^x's own EXP_REL, relative; a
    relative error rho on every weight moves the weighted mean by at most rho max|v - mean|
    <= 2 rho max|v|. The numerator and denominator: sums of n terms plus one rescale of
    the running sums per group of rows (the kernels' online softmax; numpy's blocks),
    gamma(n + n / group) relative each, and one division.
    """
    q = np.abs(np.asarray(q, np.float32))
    keys = np.abs(np.asarray(rows[:, : q.shape[1]], np.float32))
    n, d = len(keys), q.shape[1]
    s_max = abs(scale) * float((q @ keys.T).max())
    v_max = float(np.abs(np.asarray(rows[:, :r], np.float32)).max())
    rho = gamma(d + 2) * s_max + EXP_REL
    sums = 2 * gamma(n + n / group) + U32
    return (2 * rho + sums) * v_max


def mla_error(q_latent: np.ndarray, q_rope: np.ndarray, blocks, length: int,
              scale: float) -> float:
    """``attention_error`` for ``mla.mla_attention``'s arguments (every head's queries)."""
    heads_r = q_latent.shape[-1]
    q = np.concatenate([q_latent, q_rope], axis=-1).reshape(-1, heads_r + q_rope.shape[-1])
    rows = np.concatenate([np.asarray(b, np.float32) for b in blocks])[:length]
    return attention_error(q, rows, heads_r, scale)


def delta_rule_magnitude(body: np.ndarray, v: np.ndarray, log_decay: np.ndarray,
                         beta: np.ndarray) -> float:
    """An upper bound on every column norm |S[h, :, j]| a KDA state reaches from ``body``
    [H, d, d] over tokens v [T, H, d], log_decay [T, H, d], beta [T, H]: with a unit key the
    step S <- (I - beta k k^T) diag(a) S + beta k v^T scales a column's norm by at most
    max(a) and adds beta |v_j|."""
    m = np.linalg.norm(np.asarray(body, np.float64), axis=1)  # [H, d]
    top = m.copy()
    a_max = np.exp(np.asarray(log_decay, np.float64).max(axis=2))  # [T, H]
    for t in range(len(v)):
        m = a_max[t][:, None] * m + np.asarray(beta[t], np.float64)[:, None] * np.abs(v[t])
        top = np.maximum(top, m)
    return float(top.max())


def delta_rule_error(tokens: int, d: int, block: int, magnitude: float) -> float:
    """The largest error of one float32 run of the delta rule over ``tokens`` tokens with
    head width ``d``, on the state's entries and the outputs (unit-norm keys, queries of
    norm <= 1), absolute. Each token's read-back S^T k, the output S^T q and the update
    sum d products of entries bounded by the column norm ``magnitude``; a chunked or queued
    form adds a ``block``-term sum per token (the chunk's triangular solve and products, or
    the queued corrections). The step is non-expansive, so earlier errors are carried, not
    grown: over the run, gamma(tokens * (d + block)) of ``magnitude``."""
    return gamma(tokens * (d + block)) * magnitude


def max_abs(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())


def expanded_vs_absorbed_error(q_latent: np.ndarray, q_rope: np.ndarray, latent: np.ndarray,
                               key_basis: np.ndarray, value_basis: np.ndarray,
                               w_vb: np.ndarray, scale: float) -> float:
    """How far MLA's output W_vb ctx may differ between the absorbed form (scores and
    context over whole latent rows, mla.py) and the expanded one (mla_expanded.py: rows
    projected per head on orthonormal bases U, V; context taken back through V), each
    evaluated in float32 over every row (no mask: it only drops terms). Exact in exact
    arithmetic, so the bound is the sum of both forms' rounding, per head:

    - a score's error, absolute: absorbed, gamma(r + rope + 2) of scale |q|.|c|; expanded,
      each projection (U^T q, U^T c) an r-term sum, then a (d_nope + rope)-term sum:
      gamma(r) (|U|^T|q|.|U^T c| + |U^T q|.|U|^T|c|) + gamma(d_nope + rope + 2) |U^T q|.|U^T c|;
    - the weights' relative error rho (that and e^x's) moves the output by at most
      2 rho max_j |W_vb c_j| (the weighted mean of the rows' outputs, reweighted);
    - the context's sums over n rows (+ one rescale per 64), rounding each channel
      independently, reach the output through a row of W_vb (absorbed) or W_vb V
      (expanded): that row's 2-norm, as independent errors combine;
    - the value projection V^T c (r terms) and the way back, V (d_v terms) and W_vb (r
      terms): gamma of their lengths times the magnitudes they sum, |W_vb||V||V^T c|-sized
      for the expanded form, |W_vb||ctx| for both.
    """
    _, h, r = q_latent.shape
    n = len(latent)
    c = latent[:, :r].astype(np.float64)
    k_rope = np.abs(latent[:, r:].astype(np.float64))
    sums = 2 * gamma(n + n / 64) + U32
    worst = 0.0
    for head in range(h):
        u, v, w = (a[head].astype(np.float64) for a in (key_basis, value_basis, w_vb))
        q = q_latent[:, head].astype(np.float64)
        qr = np.abs(q_rope[:, head].astype(np.float64))
        rope_part = qr @ k_rope.T
        absorbed_score = abs(scale) * gamma(r + k_rope.shape[1] + 2) * float(
            (np.abs(q) @ np.abs(c).T + rope_part).max())
        qt, kt = np.abs(q @ u), np.abs(c @ u)
        qa, ka = np.abs(q) @ np.abs(u), np.abs(c) @ np.abs(u)
        expanded_score = abs(scale) * float((
            gamma(r) * (qa @ kt.T + qt @ ka.T)
            + gamma(u.shape[1] + k_rope.shape[1] + 2) * (qt @ kt.T + rope_part)).max())
        y_max = float(np.abs(c @ w.T).max())  # the rows' outputs W_vb c_j
        vt = c @ v  # V^T c, the expanded values
        wv = w @ v
        ctx_max = float(np.abs(vt).max())  # |V^T ctx| <= max |V^T c_j|: a weighted mean
        absorbed = (2 * (absorbed_score + EXP_REL) * y_max
                    + float(np.linalg.norm(w, axis=1).max()) * sums * float(np.abs(c).max())
                    + gamma(r) * float((np.abs(w) @ np.abs(c).T).max()))
        expanded = (2 * (expanded_score + EXP_REL) * y_max
                    + float(np.linalg.norm(wv, axis=1).max()) * sums * ctx_max
                    + float(np.linalg.norm(wv, axis=1).max()) * gamma(r)
                    * float((np.abs(c) @ np.abs(v)).max())
                    + gamma(v.shape[1] + r) * float((np.abs(w) @ np.abs(v)).sum(axis=1).max())
                    * ctx_max)
        worst = max(worst, absorbed + expanded)
    return worst


def model_error(config, tokens: int, magnitude: float) -> float:
    """A first-order estimate of how far two float32 evaluations of the whole model (ours
    and transformers', two piece splits, compiled and numpy glue) put a logit apart, for
    ``tokens`` tokens and logits of size ``magnitude``.

    Every rounding on a token's path to its logits, taken as one long sum of independent
    errors (the probabilistic model above): per layer the sums of the norms and
    projections (hidden-size terms each: the input norm, the attention's projections in
    and out, the post-attention norm, the router, an expert's two projections, of the
    intermediate sizes), the attention (MLA: r + rope terms per score, one per row seen)
    or the KDA delta rule (a head width plus a 64-token chunk's terms per token seen), and
    the head (hidden-size terms). First order: the residual stream carries each layer's
    error to the logits without amplifying it (RMSNorm divides out the scale, softmax and
    the delta rule are non-expansive); the estimate is doubled for two evaluations."""
    c = config
    h = c.hidden_size
    mla = c.kv_lora_rank + c.qk_rope_head_dim + tokens
    kda = tokens * (c.kda_head_dim + 64)
    per_layer = 6 * h + 2 * max(c.intermediate_size, c.moe_intermediate_size) + max(mla, kda)
    return 2 * gamma(c.num_hidden_layers * per_layer + h) * magnitude

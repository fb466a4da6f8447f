"""CPU glue against straightforward references: KDA chunked vs per-token recurrence, the
short conv in pieces, absorbed MLA vs expanded K/V attention, RoPE, and routing vs a
literal transcription of transformers' router."""

from __future__ import annotations

import numpy as np
import pytest
from fp_bounds import (
    EXP_REL,
    U32,
    delta_rule_error,
    delta_rule_magnitude,
    gamma,
    max_abs,
    mla_error,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ling3_rknn.model import kda as kda_module
from ling3_rknn.model import native
from ling3_rknn.model.kda import (
    RecurrentState,
    kda_chunked,
    kda_core,
    kda_recurrent,
    prepare_qkv,
    short_conv,
)
from ling3_rknn.model.mla import _split, apply_rope, mla_attention, rope_angles
from ling3_rknn.model.moe import NumpyExperts, route
from ling3_rknn.model.stages import swiglu
from ling3_rknn.model.state import BLOCK_TOKENS, LatentCache

F32 = np.float32


def kda_inputs(rng, t, h=3, d=16):
    conv = rng.standard_normal((t, 3 * h * d)).astype(F32)
    q, k, v = prepare_qkv(conv, h, d)
    g = (-5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((t, h, d))))).astype(F32)
    beta = rng.random((t, h)).astype(F32)
    return q, k, v, g, beta


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("t", [1, 5, 64, 65, 150])
def test_chunked_kda_equals_recurrence(t, compiled, monkeypatch):
    """Both forms of the chunked path: numpy's (the reference) and kda_chunk.c's (numpy's
    chunked heads switched off, so a quiet fallback cannot pass for the kernel)."""
    if compiled and not native.available():
        pytest.skip("the compiled kernels are not built here")
    if compiled:
        monkeypatch.setattr(kda_module, "_chunked_heads", None)
    rng = np.random.default_rng(t)
    q, k, v, g, beta = kda_inputs(rng, t)
    s0 = (0.3 * rng.standard_normal((3, 16, 16))).astype(F32)  # non-zero initial state
    s_rec, s_chk = RecurrentState(s0.copy()), RecurrentState(s0.copy())
    o_rec = kda_recurrent(q, k, v, g, beta, s_rec)
    native.set_enabled(compiled)
    try:
        o_chk = kda_chunked(q, k, v, g, beta, s_chk)
    finally:
        native.set_enabled(True)
    # two float32 runs of t tokens: d-term reads, a 64-token chunk's solve and products
    bound = 2 * delta_rule_error(t, 16, 64, delta_rule_magnitude(s0, v, g, beta))
    np.testing.assert_allclose(o_chk, o_rec, atol=bound, rtol=0)
    np.testing.assert_allclose(s_chk.value(), s_rec.value(), atol=bound, rtol=0)


@pytest.mark.parametrize("strength", [0.1, 1.0, 5.0, "mixed"])
def test_recurrence_matches_literal_delta_rule(strength):
    """Strong decay drives the lazy scale below its fold threshold many times; "mixed" has
    a few fast-decaying rows among undecayed ones (row-wise folds by index, with queued
    corrections pending); 120 tokens cross several flushes of the queued corrections."""
    rng = np.random.default_rng(1)
    t_len = 120
    q, k, v, _, beta = kda_inputs(rng, t_len, h=2, d=8)
    if strength == "mixed":
        g = np.zeros((t_len, 2, 8), F32)
        g[:, 0, 3] = -4.0 * rng.random(t_len)
        g[:, 1, 6] = -2.0
    else:
        g = (-strength * rng.random((t_len, 2, 8))).astype(F32)
    g[60, 0] = -200.0  # exp underflows to 0 in float32: head 0 is wiped at once
    s = RecurrentState.zeros((2, 8, 8))
    # one float32 run against float64: d-term reads and up to PENDING queued corrections
    bound = delta_rule_error(t_len, 8, RecurrentState.PENDING,
                             delta_rule_magnitude(s.body, v, g, beta))
    outs = [
        kda_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        for t in range(t_len)
    ]
    out = np.concatenate(outs)
    ref = np.zeros((2, 8, 8), np.float64)
    for t in range(t_len):
        for h in range(2):
            ref[h] = np.diag(np.exp(g[t, h].astype(np.float64))) @ ref[h]
            e = ref[h].T @ k[t, h]
            ref[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - e))
            np.testing.assert_allclose(out[t, h], ref[h].T @ q[t, h], atol=bound)
    np.testing.assert_allclose(s.value(), ref, atol=bound)


@pytest.mark.parametrize("d", [8, 16], ids=["numpy-width", "kernel-width"])
def test_decode_prefill_decode_with_snapshots_matches_literal(d):
    """The engine's pattern: decode steps (corrections queued), a snapshot mid-queue, a
    chunked prefill piece (which must apply the queue first), more decode; and a state
    restored from the snapshot continues identically. At d = 16 the compiled chunk kernel
    (where built) takes the pieces of 5 tokens and more; at 8 it refuses them."""
    rng = np.random.default_rng(7)
    h = 2
    pieces = [1, 1, 1, 20, 1, 1, 5, 1, 70, 1]
    t_len = sum(pieces)
    q, k, v, _, beta = kda_inputs(rng, t_len, h=h, d=d)
    g = (-0.5 * rng.random((t_len, h, d))).astype(F32)
    s = RecurrentState((0.2 * rng.standard_normal((h, d, d))).astype(F32))
    ref = s.body.astype(np.float64)
    # one float32 run against float64; the pieces take the recurrent and chunked forms
    bound = delta_rule_error(t_len, d, 64, delta_rule_magnitude(s.body, v, g, beta))
    start, outs, snap = 0, [], None
    for n in pieces:
        sl = slice(start, start + n)
        outs.append(kda_core(q[sl], k[sl], v[sl], g[sl], beta[sl], s))
        start += n
        if start == 2:
            snap = (start, s.value())
    for t in range(t_len):
        for j in range(h):
            ref[j] = np.diag(np.exp(g[t, j].astype(np.float64))) @ ref[j]
            e = ref[j].T @ k[t, j]
            ref[j] += np.outer(k[t, j], beta[t, j] * (v[t, j] - e))
            np.testing.assert_allclose(np.concatenate(outs)[t, j], ref[j].T @ q[t, j],
                                       atol=bound)
    np.testing.assert_allclose(s.value(), ref, atol=bound)
    at, value = snap
    restored = RecurrentState.zeros((h, d, d))
    restored.set(value)
    for t in range(at, t_len):
        sl = slice(t, t + 1)
        kda_core(q[sl], k[sl], v[sl], g[sl], beta[sl], restored)
    np.testing.assert_allclose(restored.value(), ref, atol=bound)


def test_recurrent_state_value_fold_and_set():
    rng = np.random.default_rng(4)
    s = RecurrentState(rng.standard_normal((2, 4, 3)).astype(F32))
    s.decay(0.5 + 0.5 * rng.random((2, 4)).astype(F32))  # the row scales only
    assert not np.array_equal(s.value(), s.body)
    expect = s.body * s.scale[:, :, None]
    np.testing.assert_array_equal(s.value(), expect)  # the same one product per entry
    s.fold()
    np.testing.assert_array_equal(s.body, expect)
    assert (s.scale == 1).all()
    s.set(np.ones((2, 4, 3), F32))
    assert s.value().sum() == 24


def test_short_conv_in_pieces_equals_whole():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((30, 12)).astype(F32)
    kernel = rng.standard_normal((12, 4)).astype(F32)
    taps = np.ascontiguousarray(kernel.T)
    whole, tail = short_conv(x, np.zeros((3, 12), F32), taps)
    # literal causal conv with zero history
    pad = np.concatenate([np.zeros((3, 12), F32), x])
    lit = sum(pad[j : j + 30] * kernel[:, j] for j in range(4))
    # the same 4-term sums in another order (2 gamma(4) of sum |x||w|), then x sigmoid(x):
    # e^x's error and three roundings, relative, of a value no larger than |x|
    size = sum(np.abs(pad[j : j + 30] * kernel[:, j]) for j in range(4))
    np.testing.assert_allclose(whole, lit / (1 + np.exp(-lit)), rtol=0,
                               atol=(2 * gamma(4) + 2 * (EXP_REL + 3 * U32)) * size.max())
    np.testing.assert_array_equal(tail, x[-3:])
    t, parts = np.zeros((3, 12), F32), []
    for a, b in ((0, 1), (1, 2), (2, 17), (17, 30)):
        out, t = short_conv(x[a:b], t, taps)
        parts.append(out)
    np.testing.assert_array_equal(np.concatenate(parts), whole)  # the same sums per row


def hf_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb_interleave: rotated pairs written de-interleaved."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def test_rope_scores_equal_transformers_layout():
    rng = np.random.default_rng(3)
    pos = np.arange(40, 50)
    cos, sin = rope_angles(pos, 8, 6e6)
    q = rng.standard_normal((10, 4, 8)).astype(F32)
    k = rng.standard_normal((10, 1, 8)).astype(F32)
    ours = np.einsum("thd,sd->ths", apply_rope(q, cos, sin), apply_rope(k[:, 0], cos, sin))
    ref = np.einsum("thd,sd->ths", hf_rope(q, cos, sin), hf_rope(k, cos, sin)[:, 0])
    # a rotated value is a 2-term sum, a score an 8-term sum of their products: two
    # float32 evaluations within 2 gamma(8 + 2 + 2) of sum |q||k| (|rotated| <= |x| pairs)
    size = np.einsum("thd,sd->ths", np.abs(q), np.abs(k[:, 0])) * 2
    assert (np.abs(ours - ref) <= 2 * gamma(12) * size).all()
    # position 0 is the identity (cos 1, sin 0: exact), and rotation preserves norms up to
    # the rotation's 2-term sums and the norm's 8-term sum, both sides
    c0, s0 = rope_angles(np.array([0]), 8, 6e6)
    np.testing.assert_array_equal(apply_rope(q[:1], c0, s0), q[:1])
    np.testing.assert_allclose(
        np.linalg.norm(apply_rope(q, cos, sin), axis=-1), np.linalg.norm(q, axis=-1),
        rtol=2 * gamma(2 + 8 + 1))


def naive_mla(q_nope, q_rope, rows, w_kb, w_vb, scale):
    """Expanded K/V attention as transformers computes it (float64)."""
    r = w_kb.shape[2]
    t, h = q_nope.shape[:2]
    c_kv, k_rope = rows[:, :r].astype(np.float64), rows[:, r:].astype(np.float64)
    k_nope = np.einsum("hnr,sr->shn", w_kb, c_kv)
    v = np.einsum("hvr,sr->shv", w_vb, c_kv)
    n = len(rows)
    out = np.zeros((t, h, w_vb.shape[1]))
    for i in range(t):
        p = n - t + i  # absolute position of query i
        s = np.einsum("hn,shn->hs", q_nope[i], k_nope[: p + 1]) + q_rope[i] @ k_rope[: p + 1].T
        s = s * scale
        w = np.exp(s - s.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hs,shv->hv", w, v[: p + 1])
    return out


@pytest.mark.parametrize(
    ("context", "t", "growth"),
    [(1, 1, 0), (300, 1, 0), (300, 70, 0), (600, 130, 0), (1300, 1, 3), (1100, 600, 3)],
)
def test_absorbed_mla_equals_expanded(context, t, growth):
    """Longer contexts span several score groups; ``growth`` makes later keys score ever
    higher, so the running softmax maximum moves from group to group."""
    rng = np.random.default_rng(context + t)
    h, dn, dr, dv, r = 4, 6, 4, 10, 12
    rows = rng.standard_normal((context, r + dr)).astype(F32)
    rows *= (1 + growth * np.arange(context) / context).astype(F32)[:, None]
    cache = LatentCache(r + dr)
    cache.append(rows[: context - t])
    cache.append(rows[context - t :])
    assert len(cache.blocks()) == -(-context // BLOCK_TOKENS)
    q_nope = rng.standard_normal((t, h, dn)).astype(F32)
    q_rope = rng.standard_normal((t, h, dr)).astype(F32)
    w_kb = rng.standard_normal((h, dn, r)).astype(F32)
    w_vb = rng.standard_normal((h, dv, r)).astype(F32)
    # the stages absorb W_kb into the query and apply W_vb to the returned latent context
    q_latent = np.einsum("thn,hnr->thr", q_nope, w_kb)
    ctx = mla_attention(q_latent, q_rope, cache.blocks(), cache.length, 0.3)
    assert ctx.shape == (t, h, r)
    got = np.einsum("thr,hvr->thv", ctx, w_vb)
    ref = naive_mla(q_nope, q_rope, rows, w_kb, w_vb, 0.3)
    # float32 against float64: the absorbed query's dn-term sums move each score by up to
    # gamma(dn) of scale (|q_nope||W_kb|).|c|, the attention's own (mla_error), the
    # context carried through a row of W_vb (|W_vb| row sum) and W_vb's r-term sum
    c = np.abs(rows[:, :r].astype(np.float64))
    q_err = 0.3 * gamma(dn) * float((np.einsum("thn,hnr->thr", np.abs(q_nope), np.abs(w_kb))
                                     .reshape(-1, r) @ c.T).max())
    w_row = float(np.abs(w_vb).sum(axis=2).max())
    bound = (w_row * (mla_error(q_latent, q_rope, cache.blocks(), context, 0.3)
                      + 2 * q_err * float(c.max()))
             + gamma(r) * w_row * float(c.max()))
    assert max_abs(got, ref) <= bound


@pytest.mark.parametrize(("context", "t", "parts"),
                         [(2100, 1, 2), (3000, 1, 3), (2600, 1, 4), (3000, 70, 2), (2400, 5, 3)])
def test_mla_split_across_threads_matches_one_pass(context, t, parts):
    """The thread split (ranges of whole blocks, partial softmax states merged) gives the
    one-pass result; the growing keys move the max between the ranges."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(context + parts)
    h, dr, r = 4, 4, 12
    rows = rng.standard_normal((context, r + dr)).astype(F32)
    rows *= (1 + 3 * np.arange(context) / context).astype(F32)[:, None]
    cache = LatentCache(r + dr)
    cache.append(rows)
    q_latent = rng.standard_normal((t, h, r)).astype(F32)
    q_rope = rng.standard_normal((t, h, dr)).astype(F32)
    one = mla_attention(q_latent, q_rope, cache.blocks(), cache.length, 0.3)
    assert len(_split(cache.blocks(), context - t + 1, context - t, parts)) == parts
    with ThreadPoolExecutor(parts - 1) as pool:
        split = mla_attention(q_latent, q_rope, cache.blocks(), cache.length, 0.3,
                              pool=pool, parts=parts)
    assert max_abs(split, one) <= 2 * mla_error(q_latent, q_rope, cache.blocks(), context, 0.3)


def hf_route(logits, bias, n_group, topk_group, top_k, normalize, scaling):
    """Literal per-token transcription of BailingHybridTopkRouter.forward (float64)."""
    ids, weights = [], []
    for z in logits.astype(np.float64):
        s = 1 / (1 + np.exp(-z))
        c = s + bias
        groups = c.reshape(n_group, -1)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        masked = np.full_like(c, -np.inf)
        for g in keep:
            sl = slice(g * groups.shape[1], (g + 1) * groups.shape[1])
            masked[sl] = c[sl]
        pick = np.argsort(-masked, kind="stable")[:top_k]
        w = s[pick]
        if normalize:
            w = w / (w.sum() + 1e-20)
        ids.append(sorted(pick.tolist()))
        weights.append(dict(zip(pick.tolist(), (w * scaling).tolist(), strict=True)))
    return ids, weights


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.sampled_from(
        [(8, 4, 2, 2), (16, 4, 2, 4), (128, 8, 4, 8), (8, 1, 1, 3), (6, 3, 3, 2)]
    ),
    normalize=st.booleans(),
    t=st.integers(1, 5),
)
def test_routing_matches_transformers(seed, shape, normalize, t):
    e, n_group, topk_group, top_k = shape
    rng = np.random.default_rng(seed)
    logits = (2 * rng.standard_normal((t, e))).astype(F32)
    bias = (0.1 * rng.standard_normal(e)).astype(F32)
    ids, w = route(
        logits,
        bias,
        n_group=n_group,
        topk_group=topk_group,
        top_k=top_k,
        normalize=normalize,
        scaling=2.5,
    )
    ref_ids, ref_w = hf_route(logits, bias, n_group, topk_group, top_k, normalize, 2.5)
    assert ids.shape == w.shape == (t, top_k) and w.dtype == np.float32
    for row in range(t):
        assert sorted(ids[row].tolist()) == ref_ids[row]
        for e_id, weight in zip(ids[row].tolist(), w[row].tolist(), strict=True):
            # a sigmoid (e^x and 2 roundings), a top_k-term normalising sum, a division
            # and the scaling, in float32 against float64
            rel = EXP_REL + 2 * U32 + gamma(top_k) + 2 * U32
            assert weight == pytest.approx(ref_w[row][e_id], rel=rel)


def test_expert_bias_steers_selection_but_not_weights():
    logits = np.zeros((1, 8), F32)
    bias = np.array([0, 0, 0, 0, 0, 0, 1.0, 2.0], F32)
    ids, w = route(logits, bias, n_group=1, topk_group=1, top_k=2, normalize=False, scaling=1.0)
    assert sorted(ids[0].tolist()) == [6, 7]
    np.testing.assert_allclose(w, 0.5)  # sigmoid(0), the unbiased score


def test_numpy_experts_batch_equals_per_token():
    rng = np.random.default_rng(5)
    d, inter, e = 8, 6, 5
    table = {
        i: (
            rng.standard_normal((2 * inter, d)).astype(F32),
            rng.standard_normal((d, inter)).astype(F32),
        )
        for i in range(e)
    }
    experts = NumpyExperts(lambda layer, i: table[i])
    x = rng.standard_normal((7, d)).astype(F32)
    ids = np.array([rng.choice(e, 2, replace=False) for _ in range(7)])
    w = rng.random((7, 2)).astype(F32)
    batch = experts(1, x, ids, w)
    for t in range(7):
        single = experts(1, x[t : t + 1], ids[t : t + 1], w[t : t + 1])
        ref = sum(w[t, j] * swiglu(x[t], *table[ids[t, j]]) for j in range(2))
        np.testing.assert_allclose(single[0], ref, atol=1e-5)
        np.testing.assert_allclose(batch[t], ref, atol=1e-5)


def test_rms_norm_eps_sits_inside_the_square_root():
    """Small and all-zero rows are where eps decides the result: x / sqrt(mean(x^2) + eps),
    not x / (sqrt(mean(x^2)) + eps) (transformers' RMSNorm)."""
    from ling3_rknn.model.stages import rms_norm

    eps = 1e-6
    x = np.array([[1e-3, -1e-3, 1e-3, -1e-3], [0.0, 0.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]],
                 np.float32)
    w = np.array([1.0, 2.0, 0.5, 1.0], np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * w
    got = rms_norm(x, w, eps)
    # float32 against float64: a 4-term sum of squares, the eps, a square root, a
    # division and the weight, 8 roundings in all, relative
    np.testing.assert_allclose(got, want, rtol=gamma(8), atol=0)
    assert abs(got[0, 0]) == pytest.approx(1 / np.sqrt(2), rel=1e-4)  # not ~1.0
    assert np.all(got[1] == 0)


def test_recurrent_state_hands_the_kernel_its_own_buffers():
    """What the compiled step writes into lands in the state; the state counts the step
    and flushes a full queue itself."""
    rng = np.random.default_rng(5)
    s = RecurrentState(rng.standard_normal((2, 4, 3)).astype(F32))
    buffers = s.kernel_buffers()
    assert buffers.body is s.body and buffers.scale is s.scale and buffers.pending == 0
    assert buffers.keys.shape == (2, s.PENDING, 4) and buffers.deltas.shape == (2, s.PENDING, 3)
    before = s.value()
    for step in range(s.PENDING):
        b = s.kernel_buffers()
        assert b.pending == step
        b.keys[:, step] = 1.0  # as kda_decode.c queues one correction
        b.deltas[:, step] = 0.5
        s.kernel_step_done()
    assert s.pending == 0  # the full queue was applied to the body
    # 16 products 1 x 0.5 summed are exactly 8 in float32: one rounding, as in the expected
    np.testing.assert_array_equal(s.value(), before + np.float32(s.PENDING * 0.5))

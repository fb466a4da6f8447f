"""The compiled glue kernels (ling3_rknn/model/mla_attention.c, kda_decode.c, kda_chunk.c)
against the numpy paths they replace.

The numpy paths are the reference: ``mla._attend`` for the MLA attention, ``short_conv`` +
``prepare_qkv`` + ``kda_recurrent`` for a KDA decode token, numpy's ``kda_chunked`` for a
KDA prefill piece. The kernels must agree with them within the float32 rounding of two
evaluations in different orders (tests/fp_bounds.py: accumulation length and magnitudes),
at Ling-3.0-tiny's dimensions (the vectorised paths) and at other sizes (the generic
paths), over every case a decode meets: caches of any length and split, the KDA queue
filling and flushing, rows folded. The numerics tests run once per vector width this
machine can build and run (the ``kernel_march`` fixture, tests/conftest.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fp_bounds import (
    EXP_REL,
    U32,
    delta_rule_error,
    delta_rule_magnitude,
    max_abs,
    mla_error,
)

from ling3_rknn.model import kda as kda_module
from ling3_rknn.model import mla, native, native_build
from ling3_rknn.model.kda import (
    RecurrentState,
    kda_chunked,
    kda_decode,
    kda_recurrent,
    prepare_qkv,
    short_conv,
)


def _numpy_attention(*args, **kwargs) -> np.ndarray:
    native.set_enabled(False)
    try:
        return mla.mla_attention(*args, **kwargs)
    finally:
        native.set_enabled(True)


def _cache(rng: np.random.Generator, lengths: list[int], width: int) -> list[np.ndarray]:
    return [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]


def _query(rng: np.random.Generator, heads: int, r: int, rope: int, spread: float = 1.0):
    return ((spread * rng.standard_normal((1, heads, r))).astype(np.float32),
            (spread * rng.standard_normal((1, heads, rope))).astype(np.float32))


def _agree(got: np.ndarray, want: np.ndarray, q_latent, q_rope, blocks, length, scale
           ) -> None:
    """Kernel and numpy: two float32 evaluations, each within ``mla_error`` of the exact."""
    bound = 2 * mla_error(q_latent, q_rope, blocks, length, scale)
    assert max_abs(got, want) <= bound, (max_abs(got, want), bound)


needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="the MLA decode kernel is not built here")
# the numerics tests: once per kernel build this machine makes and runs (conftest.py)
per_isa = pytest.mark.usefixtures("kernel_march")


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler on this machine")
def test_kernels_are_built_and_load_where_a_compiler_exists():
    """conftest.py builds them for the session, as the install step does."""
    assert native.available(), native.status()
    assert native.status().startswith(f"compiled ({native.library_path()}; ")


@needs_kernel
@per_isa
@pytest.mark.parametrize("lengths", [[1], [7], [63], [64], [65], [256, 256, 100],
                                     [256] * 4 + [1], [256, 3]])
def test_real_dimensions_match_numpy(lengths):
    rng = np.random.default_rng(len(lengths) * 1000 + lengths[-1])
    heads, r, rope = 16, 512, 64
    blocks = _cache(rng, lengths, r + rope)
    q_latent, q_rope = _query(rng, heads, r, rope)
    length = sum(lengths)
    want = _numpy_attention(q_latent, q_rope, blocks, length, 0.07)
    got = mla.mla_attention(q_latent, q_rope, blocks, length, 0.07)
    assert got.shape == (1, heads, r)
    _agree(got, want, q_latent, q_rope, blocks, length, 0.07)


@needs_kernel
@per_isa
@pytest.mark.parametrize("heads,r,rope", [(1, 8, 4), (2, 32, 16), (5, 24, 8), (32, 64, 16)])
def test_other_head_counts_match_numpy(heads, r, rope):
    rng = np.random.default_rng(heads)
    blocks = _cache(rng, [256, 256, 77], r + rope)
    q_latent, q_rope = _query(rng, heads, r, rope)
    want = _numpy_attention(q_latent, q_rope, blocks, 589, 0.2)
    _agree(mla.mla_attention(q_latent, q_rope, blocks, 589, 0.2), want, q_latent, q_rope,
           blocks, 589, 0.2)


@needs_kernel
@per_isa
def test_rising_scores_rescale_the_running_state():
    """Each later group holds a larger score, so the running max moves every group and the
    context gathered so far is rescaled each time; peaked softmax, no overflow."""
    rng = np.random.default_rng(3)
    heads, r, rope = 16, 512, 64
    blocks = _cache(rng, [256, 256, 256, 256], r + rope)
    ramp = np.linspace(0.0, 6.0, 1024, dtype=np.float32)
    for i, block in enumerate(blocks):
        block *= (1.0 + ramp[256 * i : 256 * (i + 1)])[:, None]
    q_latent, q_rope = _query(rng, heads, r, rope, spread=0.5)
    exact = _float64_attention(q_latent, q_rope, blocks, 0.3)
    got = mla.mla_attention(q_latent, q_rope, blocks, 1024, 0.3)
    assert np.isfinite(got).all()
    # scores reach ~100 here, so a score's rounding (relative to the score) moves weights
    # far more than at the other tests' sizes: each path is held to the float64 result
    # within the bound for one evaluation, which grows with the scores' size
    bound = mla_error(q_latent, q_rope, blocks, 1024, 0.3)
    assert max_abs(got, exact) <= bound
    assert max_abs(_numpy_attention(q_latent, q_rope, blocks, 1024, 0.3), exact) <= bound


def _float64_attention(q_latent, q_rope, blocks, scale) -> np.ndarray:
    rows = np.concatenate(blocks).astype(np.float64)
    q = np.concatenate([q_latent[0], q_rope[0]], axis=1).astype(np.float64) * scale
    scores = q @ rows.T
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return (weights @ rows[:, : q_latent.shape[2]])[None]


@needs_kernel
@per_isa
def test_split_ranges_merge_like_numpy():
    """Two threads each score a range of whole blocks (split-K) and the partial states merge."""
    rng = np.random.default_rng(4)
    heads, r, rope = 16, 512, 64
    blocks = _cache(rng, [256] * 12 + [40], r + rope)
    length = 256 * 12 + 40
    q_latent, q_rope = _query(rng, heads, r, rope)
    want = _numpy_attention(q_latent, q_rope, blocks, length, 0.07)
    with ThreadPoolExecutor(2) as pool:
        got = mla.mla_attention(q_latent, q_rope, blocks, length, 0.07, pool=pool, parts=3)
    _agree(got, want, q_latent, q_rope, blocks, length, 0.07)


@needs_kernel
@per_isa
def test_only_the_visible_rows_are_read():
    rng = np.random.default_rng(5)
    q_t = rng.standard_normal((40, 2)).astype(np.float32)
    blocks = _cache(rng, [16, 16], 40)
    full = native.mla_attend(q_t, blocks, 0, 20, 32)
    blocks[1][4:] = np.nan  # rows past ``visible`` must not reach the result
    again = native.mla_attend(q_t, blocks, 0, 20, 32)
    assert full is not None and again is not None
    for a, b in zip(full, again, strict=True):
        np.testing.assert_array_equal(a, b)


@needs_kernel
def test_blocks_it_cannot_read_fall_back_to_numpy():
    rng = np.random.default_rng(6)
    q_t = rng.standard_normal((40, 2)).astype(np.float32)
    wide = rng.standard_normal((16, 80)).astype(np.float32)
    assert native.mla_attend(q_t, [wide[:, :40]], 0, 16, 32) is None  # strided rows
    assert native.mla_attend(q_t, [wide[:, :40].astype(np.float64)], 0, 16, 32) is None
    assert native.mla_attend(q_t, [], 0, 0, 32) is None
    native.set_enabled(False)
    try:
        assert not native.available()
        assert native.mla_attend(q_t, [np.ascontiguousarray(wide[:, :40])], 0, 16, 32) is None
    finally:
        native.set_enabled(True)


def _chunk_query(rng: np.random.Generator, t: int, heads: int, r: int, rope: int):
    return (rng.standard_normal((t, heads, r)).astype(np.float32),
            rng.standard_normal((t, heads, rope)).astype(np.float32))


@needs_kernel
@per_isa
@pytest.mark.parametrize("lengths,t", [
    ([64], 64),                      # a first chunk: every row is the chunk's own (masked)
    ([256, 256, 100], 64),           # a chunk at depth 548, its rows in the last block
    ([256, 40], 7),                  # a short last piece
    ([256] * 4 + [1], 2),            # two tokens across a block boundary
    ([256, 256, 256, 100], 160),     # a piece longer than the numpy path's query chunk
])
def test_prefill_chunk_matches_numpy_at_real_dimensions(lengths, t):
    rng = np.random.default_rng(t * 100 + len(lengths))
    heads, r, rope = 16, 512, 64
    blocks = _cache(rng, lengths, r + rope)
    length = sum(lengths)
    q_latent, q_rope = _chunk_query(rng, t, heads, r, rope)
    want = _numpy_attention(q_latent, q_rope, blocks, length, 0.07)
    got = mla.mla_attention(q_latent, q_rope, blocks, length, 0.07)
    assert got.shape == (t, heads, r)
    _agree(got, want, q_latent, q_rope, blocks, length, 0.07)


@needs_kernel
@per_isa
@pytest.mark.parametrize("heads,r,rope,t", [(8, 128, 16, 64), (5, 24, 8, 9), (1, 8, 4, 3),
                                            (32, 64, 16, 5), (3, 32, 16, 17)])
def test_prefill_tiles_pack_any_head_count(heads, r, rope, t):
    """Columns are (token, head) pairs packed 16 to a tile, so a tile may hold several
    tokens (each lane masked at its own position) and the last one padding lanes."""
    rng = np.random.default_rng(heads * 10 + t)
    blocks = _cache(rng, [256, 300 - 256 + t], r + rope)
    length = 300 + t
    q_latent, q_rope = _chunk_query(rng, t, heads, r, rope)
    want = _numpy_attention(q_latent, q_rope, blocks, length, 0.2)
    _agree(mla.mla_attention(q_latent, q_rope, blocks, length, 0.2), want, q_latent, q_rope,
           blocks, length, 0.2)


@needs_kernel
@per_isa
def test_prefill_reads_a_float16_cache_like_numpy():
    rng = np.random.default_rng(11)
    heads, r, rope = 16, 512, 64
    blocks = [b.astype(np.float16) for b in _cache(rng, [256, 200], r + rope)]
    q_latent, q_rope = _chunk_query(rng, 64, heads, r, rope)
    want = _numpy_attention(q_latent, q_rope, blocks, 456, 0.07)
    _agree(mla.mla_attention(q_latent, q_rope, blocks, 456, 0.07), want, q_latent, q_rope,
           blocks, 456, 0.07)  # float16 -> float32 is exact on both sides: no extra term


@needs_kernel
@per_isa
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_prefill_tiles_split_over_threads_like_one(parts):
    rng = np.random.default_rng(parts)
    heads, r, rope = 8, 128, 16
    blocks = _cache(rng, [256] * 9 + [64], r + rope)
    length = 256 * 9 + 64
    q_latent, q_rope = _chunk_query(rng, 64, heads, r, rope)
    alone = mla.mla_attention(q_latent, q_rope, blocks, length, 0.1)
    with ThreadPoolExecutor(2) as pool:
        split = mla.mla_attention(q_latent, q_rope, blocks, length, 0.1, pool=pool, parts=parts)
    np.testing.assert_array_equal(split, alone)  # tiles are independent: same bits
    _agree(split, _numpy_attention(q_latent, q_rope, blocks, length, 0.1), q_latent, q_rope,
           blocks, length, 0.1)


@needs_kernel
@per_isa
def test_prefill_never_reads_rows_past_the_newest_token():
    rng = np.random.default_rng(12)
    heads, r, rope = 4, 32, 8
    blocks = _cache(rng, [256, 256], r + rope)
    q_latent, q_rope = _chunk_query(rng, 10, heads, r, rope)
    full = mla.mla_attention(q_latent, q_rope, blocks, 300, 0.1)
    blocks[1][300 - 256:] = np.nan  # rows past ``length``: allocated, never written
    np.testing.assert_array_equal(mla.mla_attention(q_latent, q_rope, blocks, 300, 0.1), full)


def _kda_inputs(rng: np.random.Generator, heads: int, d: int, decay: float):
    qkv = rng.standard_normal((1, 3 * heads * d)).astype(np.float32)
    log_decay = (-decay / (1.0 + np.exp(-rng.standard_normal((1, heads, d))))).astype(
        np.float32)
    beta = rng.random((1, heads)).astype(np.float32)
    return qkv, log_decay, beta


@needs_kernel
@per_isa
@pytest.mark.parametrize("heads,d,taps_k,parts", [(16, 128, 4, 1), (16, 128, 4, 2),
                                                  (2, 16, 4, 1), (3, 24, 3, 2), (1, 8, 2, 1)])
def test_kda_decode_tokens_match_numpy(heads, d, taps_k, parts):
    """40 tokens from a random state: the queue fills and flushes twice; from token 20 the
    decay is strong enough that rows fold. Outputs, conv tails and states agree."""
    rng = np.random.default_rng(heads * 100 + d)
    body = (0.05 * rng.standard_normal((heads, d, d))).astype(np.float32)
    reference, compiled = RecurrentState(body.copy()), RecurrentState(body.copy())
    tail = rng.standard_normal((taps_k - 1, 3 * heads * d)).astype(np.float32)
    compiled_tail = tail.copy()
    taps = (0.5 * rng.standard_normal((taps_k, 3 * heads * d))).astype(np.float32)
    folds = 0
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    inputs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    with ThreadPoolExecutor(parts) as pool:
        for step in range(40):
            qkv, log_decay, beta = _kda_inputs(rng, heads, d, 5.0 if step < 20 else 60.0)
            conv_out, tail = short_conv(qkv, tail, taps)
            q, k, v = prepare_qkv(conv_out, heads, d)
            scale_before = reference.scale.copy()
            want = kda_recurrent(q, k, v, log_decay, beta, reference)
            inputs.append((v, log_decay, beta))
            folds += int((scale_before * np.exp(log_decay[0]) < RecurrentState.FOLD_BELOW).any())
            got = kda_decode(qkv, compiled_tail, taps, log_decay, beta, compiled,
                             pool=pool if parts > 1 else None, parts=parts)
            assert got is not None and got.shape == want.shape
            runs.append((got, want))
            np.testing.assert_array_equal(compiled_tail, tail)
            assert compiled.pending == reference.pending
    assert folds > 0
    # both sides: 40 delta-rule tokens, each also a conv of taps_k products and a key norm
    # of d (the kernel computes them itself), with up to PENDING queued corrections read
    v, log_decay, beta = (np.concatenate(a) for a in zip(*inputs, strict=True))
    size = delta_rule_magnitude(body, v, log_decay, beta)
    bound = 2 * delta_rule_error(40, d, RecurrentState.PENDING + taps_k + d, size)
    for step, (got, want) in enumerate(runs):
        assert max_abs(got, want) <= bound, step
    assert max_abs(compiled.value(), reference.value()) <= bound


@needs_kernel
def test_kda_decode_leaves_what_it_cannot_take_to_numpy():
    rng = np.random.default_rng(7)
    heads, d = 2, 16
    state = RecurrentState(np.zeros((heads, d, d), np.float32))
    qkv, log_decay, beta = _kda_inputs(rng, heads, d, 5.0)
    taps = rng.standard_normal((4, 3 * heads * d)).astype(np.float32)
    tail64 = np.zeros((3, 3 * heads * d))  # float64: not the kernel's layout
    assert kda_decode(qkv, tail64, taps, log_decay, beta, state) is None
    assert state.pending == 0 and not tail64.any()
    native.set_enabled(False)
    try:
        tail = np.zeros((3, 3 * heads * d), np.float32)
        assert kda_decode(qkv, tail, taps, log_decay, beta, state) is None
        assert not tail.any()
    finally:
        native.set_enabled(True)




def _kda_piece(rng: np.random.Generator, t_len: int, heads: int, d: int, decay: float):
    conv = rng.standard_normal((t_len, 3 * heads * d)).astype(np.float32)
    q, k, v = prepare_qkv(conv, heads, d)
    log_decay = (-decay / (1.0 + np.exp(-2.0 * rng.standard_normal((t_len, heads, d))))
                 ).astype(np.float32)
    beta = rng.random((t_len, heads)).astype(np.float32)
    return q, k, v, log_decay, beta


def _no_numpy(*args, **kwargs) -> None:
    raise AssertionError("numpy's chunked form ran where the kernel should have")


def _numpy_chunked(*args, **kwargs) -> np.ndarray:
    native.set_enabled(False)
    try:
        return kda_chunked(*args, **kwargs)
    finally:
        native.set_enabled(True)


@needs_kernel
@per_isa
@pytest.mark.parametrize("heads,d,t_len,chunk,decay,parts", [
    (16, 128, 150, 64, 5.0, 1),   # Ling-3.0-tiny's KDA, a piece that ends mid-chunk
    (16, 128, 64, 64, 5.0, 2),    # one full chunk, heads split over two threads
    (8, 32, 200, 64, 0.2, 3),     # the demo's width, slow decay
    (3, 16, 70, 16, 5.0, 1),      # chunks of one diagonal block
    (2, 48, 100, 128, 1.0, 1),    # the longest chunk the kernel takes
])
def test_kda_chunk_matches_numpy(heads, d, t_len, chunk, decay, parts, monkeypatch):
    """Two pieces in a row from a random state (the state carried between them): outputs and
    state agree with numpy's chunked form. A decay of 5 takes a chunk's cumulative log decay
    to ~-300, far below where e^G underflows. numpy's chunked heads are switched off for the
    compiled call, so a quiet fallback cannot pass for the kernel."""
    rng = np.random.default_rng(heads * 1000 + d + t_len)
    body = (0.3 * rng.standard_normal((heads, d, d))).astype(np.float32)
    reference, compiled = RecurrentState(body.copy()), RecurrentState(body.copy())
    runs, tokens = [], []
    with ThreadPoolExecutor(parts) as pool:
        for _ in range(2):
            args = _kda_piece(rng, t_len, heads, d, decay)
            tokens.append(args)
            want = _numpy_chunked(*args, reference, chunk=chunk)
            with monkeypatch.context() as patch:
                patch.setattr(kda_module, "_chunked_heads", _no_numpy)
                got = kda_chunked(*args, compiled, chunk=chunk,
                                  pool=pool if parts > 1 else None, parts=parts)
            assert np.isfinite(got).all()
            runs.append((got, want, compiled.value(), reference.value()))
    # two chunked runs of 2 t_len tokens, each token a d-term read and the chunk's
    # chunk-term solve and products
    _, _, v, log_decay, beta = (np.concatenate(a) for a in zip(*tokens, strict=True))
    size = delta_rule_magnitude(body, v, log_decay, beta)
    bound = 2 * delta_rule_error(2 * t_len, d, chunk, size)
    for piece, (got, want, state_got, state_want) in enumerate(runs):
        assert max_abs(got, want) <= bound, piece
        assert max_abs(state_got, state_want) <= bound, piece


@needs_kernel
def test_kda_chunk_leaves_what_it_cannot_take_to_numpy():
    """A head width the kernel does not take (not a multiple of 16) and a float64 state: no
    call, the numpy path's result, the state untouched by the refusal."""
    rng = np.random.default_rng(5)
    args = [np.ascontiguousarray(a) for a in _kda_piece(rng, 40, 2, 24, 1.0)]
    body = np.zeros((2, 24, 24), np.float32)
    assert native.kda_chunk_call(*args, body, 64) is None
    want = _numpy_chunked(*args, RecurrentState(body.copy()))
    np.testing.assert_array_equal(kda_chunked(*args, RecurrentState(body.copy())), want)
    args16 = [np.ascontiguousarray(a) for a in _kda_piece(rng, 40, 2, 16, 1.0)]
    assert native.kda_chunk_call(*args16, np.zeros((2, 16, 16), np.float32), 64) is not None
    assert native.kda_chunk_call(*args16, np.zeros((2, 16, 16)), 64) is None
    assert native.kda_chunk_call(*args16, np.zeros((2, 16, 16), np.float32), 129) is None
    assert not native.kda_chunk_takes(24, 64) and not native.kda_chunk_takes(16, 0)


@needs_kernel
def test_kda_chunk_kernel_refuses_before_touching_anything():
    """The C side's own check (a chunk of 0 here, which the binding never passes): -1, the
    state as it was."""
    rng = np.random.default_rng(6)
    args = [np.ascontiguousarray(a) for a in _kda_piece(rng, 20, 2, 16, 1.0)]
    state = rng.standard_normal((2, 16, 16)).astype(np.float32)
    before = state.copy()
    call = native.KdaChunkCall(native._load(), *args, state, 0)
    call.run(0, 2)
    assert call.failed
    np.testing.assert_array_equal(state, before)


@needs_kernel
@per_isa
def test_softmax_weights_carry_only_e_to_the_x_and_three_roundings():
    """Two rows whose scores differ by x (-80 to 80, one value per head lane, so the
    vectorised path), values 1 and 0: the context is 1 / (1 + e^x), with exact scores and
    products, so the only errors are e^x's (EXP_REL on each weight) and the 2-row sum and
    division: relative 2 EXP_REL + 3u. The larger tests' bounds are dominated by the
    scores' rounding, so this one is what holds e^x itself to its 4 ulp."""
    x = np.linspace(-80.0, 80.0, 16).astype(np.float32)
    rows = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)  # [value | key] channels
    q_t = np.stack([np.zeros(16, np.float32), x])  # [d = 2, heads = 16]
    want = 1.0 / (1.0 + np.exp(x.astype(np.float64)))
    bound = (2 * EXP_REL + 3 * U32) * want
    decoded = native.mla_attend(q_t, [rows], 0, 2, 1)  # the context before normalising
    assert decoded is not None
    ctx, denominator, _ = decoded
    assert (np.abs(ctx[0] / denominator - want) <= bound).all()
    # the prefill kernel: the 16 values as 16 query columns at position 1 (both rows seen)
    call = native.mla_prefill(np.ascontiguousarray(q_t.T), np.ones(16, np.int64), [rows], 2, 2,
                              1)
    assert call is not None
    call.run(0, call.tiles)
    assert not call.failed
    assert (np.abs(call.result()[:, 0] - want) <= bound).all()

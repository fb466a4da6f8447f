"""The experts' int8 activation steps (ling3_rknn/model/moe_int8.py): the compiled kernels
(moe_int8.c) against the numpy forms, and the numpy forms against float arithmetic.

Bounds from the arithmetic: quantising a row to int8 with scale s = max|x| / 127 leaves an
error of at most s / 2 per value (round to nearest); the kernel and numpy compute the same
float32 product x * (127 / max|x|) and add the same half, but gcc may fuse that product
into the addition (-ffp-contract=fast: no rounding of the product), so a value within one
float32 step of a half may round the other way: at most one int8 step apart. SiLU's
e^x is Cephes' polynomial in the kernel (within 1e-7 relative of numpy's), so the float
intermediate agrees to ~2^-22 and its quantised value to within one step. The scatter's
products are float32 (one rounding each, 2^-24 relative, maybe fused: same bound)."""

from __future__ import annotations

import numpy as np
import pytest

from ling3_rknn.model import moe_int8, native

needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="the compiled kernels are not built here")


def _both(fn, *args):
    got = fn(*args)
    native.set_enabled(False)
    try:
        want = fn(*args)
    finally:
        native.set_enabled(True)
    return got, want


@needs_kernel
@pytest.mark.parametrize("d", [1536, 37, 8])
def test_quantize_rows_kernel_is_numpy(d):
    rng = np.random.default_rng(d)
    src = (rng.standard_normal((50, d)) * rng.random((50, 1)) * 10).astype(np.float32)
    src[3] = 0  # a zero row: scale 0, all zeros
    src[4, :] = 0.5
    rows = rng.integers(0, 50, 120)
    rows[:2] = 3
    (q, s), (qn, sn) = _both(moe_int8.quantize_rows, src, rows)
    assert np.abs(q.astype(np.int32) - qn).max() <= 1  # a fused product at a half
    assert (q == qn).mean() > 0.99  # and only there
    np.testing.assert_array_equal(s, sn)
    assert (q[:2] == 0).all() and (s[:2] == 0).all()
    x = src[rows]
    assert (np.abs(q.astype(np.float32) * s[:, None] - x) <= s[:, None] / 2 * (1 + 2**-20)
            ).all()  # half a step, plus the float32 rounding of x * inv
    assert np.abs(q).max() <= 127


@needs_kernel
@pytest.mark.parametrize("inter", [512, 20])
def test_swiglu_kernel_matches_numpy(inter):
    rng = np.random.default_rng(inter)
    m = 33
    c = rng.integers(-2**20, 2**20, (m, 2 * inter)).astype(np.int32)
    row_scale = (rng.random(m) * 1e-5).astype(np.float32)
    col_scale = (rng.random(2 * inter) * 1e-2).astype(np.float32)
    (q, s), (qn, sn) = _both(moe_int8.swiglu_quantize, c, row_scale, col_scale)
    # a scale is one row's max|h| / 127, h = g / (1 + e^-g) * u: e^x within 1e-7 (< 2^-23)
    # relative of numpy's on either side, then ~6 float32 roundings (dequantising g and u,
    # the sum, the division, the product, the scale), maybe fused: under 8 * 2^-23 = 2^-20
    np.testing.assert_allclose(s, sn, rtol=2**-20)
    assert np.abs(q.astype(np.int32) - qn).max() <= 1  # one step at a rounding boundary


@needs_kernel
def test_scatter_add_kernel_matches_numpy():
    rng = np.random.default_rng(9)
    m, d, t = 70, 48, 9
    c = rng.integers(-2**24, 2**24, (m, d)).astype(np.int32)
    row_scale = rng.random(m).astype(np.float32) * 1e-3
    col_scale = rng.random(d).astype(np.float32) * 1e-3
    weight = rng.random(m).astype(np.float32)
    rows = rng.integers(0, t, m)  # repeats: several experts add into one token
    outs = []
    for enabled in (True, False):
        out = np.ones((t, d), np.float32)
        native.set_enabled(enabled)
        try:
            moe_int8.scatter_add(c, row_scale, col_scale, weight, rows, out)
        finally:
            native.set_enabled(True)
        outs.append(out)
    want = np.ones((t, d))
    np.add.at(want, rows, c * col_scale[None, :].astype(np.float64)
              * (row_scale * weight)[:, None].astype(np.float64))
    terms = np.zeros((t, d))
    np.add.at(terms, rows, np.abs(c * col_scale[None, :].astype(np.float64)
                                  * (row_scale * weight)[:, None]))
    adds = np.bincount(rows, minlength=t)[:, None] + 1
    for out in outs:  # each term three float32 roundings, each of the sums one more
        assert (np.abs(out - want) <= 4 * 2**-24 * (terms + 1) * adds).all()


def test_a_row_index_outside_the_source_is_refused():
    if not native.available():
        pytest.skip("the compiled kernels are not built here")
    with pytest.raises(IndexError):
        moe_int8.quantize_rows(np.zeros((4, 8), np.float32), np.array([0, 4]))

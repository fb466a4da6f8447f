"""attn_softmax.c, the online softmax between the NPU attention's two matmuls, against
numpy's form of it (``mla_npu.softmax_piece``) and against exact e^x, on every vector width
this machine builds (conftest.py's ``kernel_march``): the float16 conversion is written per
width (F16C at 8 and 16 lanes, the compiler's _Float16 on aarch64)."""

from __future__ import annotations

import numpy as np
import pytest

from ling3_rknn.model import native
from ling3_rknn.model.mla_npu import softmax_piece

pytestmark = pytest.mark.usefixtures("kernel_march")
U = 2.0 ** -11  # one float16 rounding, relative


def _kernel_runs() -> bool:
    """The build converts to float16 (not x86-64 without F16C: numpy's path there)."""
    m, n = 1, 16
    return native.softmax_piece(np.zeros((m, n), np.float32), np.full(m, n, np.int32),
                                np.zeros(m, np.float32), np.zeros(m, np.float32),
                                np.zeros((m, 4), np.float32), np.empty((m, n), np.float16))


def test_softmax_piece_kernel_matches_numpy():
    if not _kernel_runs():
        pytest.skip("this build has no float16 conversion")
    rng = np.random.default_rng(1)
    m, n, dv = 37, 96, 24
    limits = [rng.integers(0, n + 1, m).astype(np.int32) for _ in range(3)]
    states = []
    for use_kernel in (True, False):
        run_max = np.full(m, np.finfo(np.float32).min, np.float32)
        denom = np.zeros(m, np.float32)
        acc = np.zeros((m, dv), np.float32)
        p = np.empty((m, n), np.float16)
        ps = []
        for piece, limit in enumerate(limits):
            scores = (rng.standard_normal((m, n)) * 4 + piece).astype(np.float32)
            acc += 1.0
            native.set_enabled(use_kernel)
            try:
                softmax_piece(scores, limit, run_max, denom, acc, p)
            finally:
                native.set_enabled(True)
            ps.append(p.copy())
        rng = np.random.default_rng(1)
        limits = [rng.integers(0, n + 1, m).astype(np.int32) for _ in range(3)]
        states.append((run_max, denom, acc, ps))
    (mk, dk, ak, pk), (mn, dn_, an, pn) = states
    np.testing.assert_array_equal(mk, mn)  # the max is exact
    # e^x: the kernel's within 2^-17 relative of numpy's; one float16 rounding of it may then
    # land one step apart (2^-10 relative at most for normal values, 2^-24 below 2^-14)
    for a, b in zip(pk, pn, strict=True):
        step = np.abs(np.spacing(b)).astype(np.float32)
        assert (np.abs(a.astype(np.float32) - b.astype(np.float32)) <= step).all()
    np.testing.assert_allclose(dk, dn_, rtol=2 * U * 3)  # three pieces' sums of such values
    np.testing.assert_allclose(ak, an, rtol=1e-6)  # rescale factors: expf, one product each


def test_softmax_piece_exp_is_exact_enough_for_its_float16_rounding():
    """attn_softmax.c's e^x claims 2^-17 relative (2^-18 for its polynomial, plus float32
    roundings): a float16 rounding of it then differs from the rounding of the exact value
    only where a rounding midpoint lies within 2^-17 y of y, at most 2^-17 / 2^-11 = 1/64 of
    the normal values (their midpoints are at least 2^-11 y apart), and never by more than
    one step. The kernel's polynomial flips ~0.25 % here; one coefficient off by 3e-4 (the
    error ten times larger at the interval's ends) flips 1.7 % and fails."""
    if not _kernel_runs():
        pytest.skip("this build has no float16 conversion")
    rng = np.random.default_rng(3)
    m, n = 64, 2048
    scores = (rng.standard_normal((m, n)) * 2).astype(np.float32)
    run_max = np.full(m, np.finfo(np.float32).min, np.float32)
    denom = np.zeros(m, np.float32)
    p = np.empty((m, n), np.float16)
    assert native.softmax_piece(scores, np.full(m, n, np.int32), run_max, denom,
                                np.zeros((m, 8), np.float32), p)
    exact = np.exp(scores.astype(np.float64) - scores.max(axis=1, keepdims=True))
    want = exact.astype(np.float16)
    got = p.astype(np.float64)
    step = np.abs(np.spacing(want)).astype(np.float64)
    assert (np.abs(got - want) <= step).all()
    normal = want >= 2.0**-14
    assert (got[normal] != want[normal]).mean() <= 2.0**-17 / 2.0**-11
    # the denominator is the float32 sum of the rounded values (n terms, 8 sqrt(n) 2^-24)
    np.testing.assert_allclose(denom, got.sum(axis=1), rtol=8 * np.sqrt(n) * 2.0**-24)


def test_softmax_piece_refuses_a_limit_past_the_piece():
    if not _kernel_runs():
        pytest.skip("this build has no float16 conversion")
    m, n = 2, 16
    with pytest.raises(ValueError, match="limits"):
        native.softmax_piece(np.zeros((m, n), np.float32), np.array([3, 17], np.int32),
                             np.zeros(m, np.float32), np.zeros(m, np.float32),
                             np.zeros((m, 4), np.float32), np.empty((m, n), np.float16))


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (64, 512), (5, 128)])
def test_half_rows_converts_strided_views_as_numpy_does(rows, cols):
    """The NPU operands' float16 conversion: round to nearest even like numpy's, into a
    column range of a wider array, from a strided view, scaled; nothing else written."""
    if not _kernel_runs():
        pytest.skip("this build has no float16 conversion")
    rng = np.random.default_rng(cols)
    big = (rng.standard_normal((rows, 3, cols + 5)) * 300).astype(np.float32)
    big[0, 1, 2] = 3e5  # scaled past float16's largest: inf, as numpy rounds it
    src = big[:, 1, 2:2 + cols]  # rows 3 (cols + 5) floats apart
    dst = np.full((rows, cols + 40), 1.5, np.float16)
    with np.errstate(over="ignore"):
        assert native.half_rows(src, dst[:, 7:7 + cols], 0.25)
        want = (src * np.float32(0.25)).astype(np.float16)
    np.testing.assert_array_equal(dst[:, 7:7 + cols], want)
    assert (dst[:, :7] == 1.5).all() and (dst[:, 7 + cols:] == 1.5).all()


def test_half_rows_leaves_what_it_cannot_take_to_numpy():
    if not _kernel_runs():
        pytest.skip("this build has no float16 conversion")
    src = np.ones((4, 8), np.float32)
    assert not native.half_rows(src[:, ::2], np.empty((4, 4), np.float16))  # column stride
    assert not native.half_rows(src, np.empty((4, 8), np.float32))
    assert not native.half_rows(src, np.empty((4, 7), np.float16))
    assert not native.half_rows(src.astype(np.float64), np.empty((4, 8), np.float16))

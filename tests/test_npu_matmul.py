"""The NPU matmul layer: the ctypes binding (``npu/matmul.py``) over the host stand-in
(``npu/matmul_standin.c``, built by conftest.py like the kernels), which has librknnrt's
ABI and semantics: structs pinned to the header, products against numpy with bounds from
the arithmetic, B's native layout written in pieces, every plan limit refused by both the
plan and the library, typed errors, contexts on every core and domain."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ling3_rknn.model import native_build
from ling3_rknn.npu import matmul, matmul_abi, matmul_standin_build
from ling3_rknn.npu.executors import RUNTIME_ENV
from ling3_rknn.npu.matmul_layout import SEGMENT_K, write_native
from ling3_rknn.npu.matmul_plan import (
    DOMAIN_BYTES,
    FP16_ABORT_RANGE,
    MAX_K,
    MatmulError,
    MatmulShape,
    check_shape,
)

pytestmark = pytest.mark.skipif(native_build.compiler() is None,
                                reason="no C compiler: the stand-in is not built")
HEADER = Path(matmul_standin_build.SOURCE_DIR) / "rknn_matmul_abi.h"
# fp16 unit roundoff of a float32 sum (2^-24): see _fp16_bound.
F32_U = 2.0 ** -24


@pytest.fixture
def runtime():
    rt = matmul.open_runtime("mock")
    yield rt
    rt.close()


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _fp16_operands(rng, m, k, n):
    return (rng.standard_normal((m, k)).astype(np.float16),
            rng.standard_normal((k, n)).astype(np.float16))


def _fp16_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|C - A.B| for fp16 inputs summed in float32: each product of two fp16 values
    (11-bit significands) is exact in float32 (24 bits), so only the k additions round,
    each by at most 2^-24 of a partial sum: |error| <= k * 2^-24 * sum |a||b| in any
    summation order (the reference in float64 is off by k * 2^-53 of the same, nothing
    next to it)."""
    k = a.shape[1]
    return k * F32_U * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


def _exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype == np.int8:
        return a.astype(np.int64) @ b.astype(np.int64)
    return a.astype(np.float64) @ b.astype(np.float64)


# --- the structs against the header ------------------------------------------------------

def _pin_program(include: str) -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{include}"',
             "int main(void) {"]
    for cname, cls in matmul_abi.STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for field, *_ in cls._fields_:
            lines.append(f'printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    lines.append('printf("rknn_matmul_ctx sizeof %zu\\n", sizeof(rknn_matmul_ctx));')
    return "\n".join([*lines, "return 0; }"])


def _compiled_layout(tmp_path: Path, include: Path) -> dict[str, int]:
    source = tmp_path / "pin.c"
    source.write_text(_pin_program(include.name))
    exe = tmp_path / "pin"
    subprocess.run([native_build.compiler() or "cc", f"-I{include.parent}", "-o", str(exe),
                    str(source)], check=True, capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {f"{s} {f}": int(v) for s, f, v in (ln.split() for ln in out.splitlines())}


def _ctypes_layout() -> dict[str, int]:
    layout = {}
    for cname, cls in matmul_abi.STRUCTS.items():
        layout[f"{cname} sizeof"] = ctypes.sizeof(cls)
        for field, *_ in cls._fields_:
            layout[f"{cname} {field}"] = getattr(cls, field).offset
    layout["rknn_matmul_ctx sizeof"] = ctypes.sizeof(matmul_abi.Context)
    return layout


def test_structs_match_the_header(tmp_path):
    """Every size and field offset of the ctypes mirror equals what the C compiler lays out
    for rknn_matmul_abi.h (the header the stand-in is built from)."""
    compiled = _compiled_layout(tmp_path, HEADER)
    assert compiled == _ctypes_layout()
    assert compiled["rknn_matmul_info sizeof"] == 64  # SDK 2.3.2, any 32/64-bit ABI


@pytest.mark.skipif(not os.environ.get("LING3_RKNN_SDK_INCLUDE"),
                    reason="LING3_RKNN_SDK_INCLUDE (the SDK's include directory) not set")
def test_structs_match_the_sdk_header(tmp_path):
    """With Rockchip's own headers at hand (rknpu2/runtime/Linux/librknn_api/include of
    rknn-toolkit2, not shipped here), the retyped header agrees with them."""
    sdk = Path(os.environ["LING3_RKNN_SDK_INCLUDE"]) / "rknn_matmul_api.h"
    assert _compiled_layout(tmp_path, sdk) == _ctypes_layout()


# --- products ---------------------------------------------------------------------------

@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (7, 192, 48), (64, 2048, 128),
                                   (3, SEGMENT_K + 2048, 32)])
def test_fp16_products_within_the_float32_bound(runtime, m, k, n):
    a, b = _fp16_operands(_rng(k), m, k, n)
    ctx = runtime.context(MatmulShape(m, k, n, "fp16"))
    bb = ctx.new_b()
    ctx.write_b(bb, b)
    c = ctx.run(a, bb)
    assert c.dtype == np.float32 and c.shape == (m, n)
    assert np.all(np.abs(c - _exact(a, b)) <= _fp16_bound(a, b))


def test_fp16_rounds_float_inputs_to_fp16(runtime):
    """float32 operands are rounded to fp16 on the way in (round to nearest even), so the
    product is that of the rounded values."""
    rng = _rng(1)
    a32, b32 = rng.standard_normal((4, 64)), rng.standard_normal((64, 16)).astype(np.float32)
    ctx = runtime.context(MatmulShape(4, 64, 16, "fp16"))
    bb = ctx.new_b()
    ctx.write_b(bb, b32)
    c = ctx.run(a32, bb)
    a16, b16 = a32.astype(np.float16), b32.astype(np.float16)
    assert np.all(np.abs(c - _exact(a16, b16)) <= _fp16_bound(a16, b16))
    assert np.array_equal(bb.normal(), b16)


@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (16, 1536, 1024), (5, 512, 96),
                                   (2, SEGMENT_K + 32, 64)])
def test_int8_products_are_exact(runtime, m, k, n):
    rng = _rng(m + k)
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    ctx = runtime.context(MatmulShape(m, k, n, "int8"))
    bb = ctx.new_b()
    ctx.write_b(bb, b)
    c = ctx.run(a, bb)
    assert c.dtype == np.int32
    assert np.array_equal(c, _exact(a, b))


def test_int8_extremes_accumulate_in_int32_without_wrapping(runtime):
    """K = 10240 rows of (-128)(-128) is 167,772,160 and of (-128)(127) -166,461,440: past
    int16 and int24, inside int32 (no int8 x int8 sum over an allowed K can overflow it,
    so the library has nothing to saturate)."""
    k = MAX_K
    ctx = runtime.context(MatmulShape(2, k, 32, "int8"))
    a = np.full((2, k), -128, np.int8)
    a[1] = 127
    b = np.full((k, 32), -128, np.int8)
    b[:, 16:] = 127
    bb = ctx.new_b()
    ctx.write_b(bb, b)
    c = ctx.run(a, bb)
    assert c[0, 0] == k * 128 * 128 and c[0, 16] == -k * 128 * 127
    assert c[1, 0] == -k * 127 * 128 and c[1, 16] == k * 127 * 127
    assert np.array_equal(c, _exact(a, b))


def test_fewer_rows_and_out(runtime):
    """A with fewer than m rows gives their rows of C; ``out`` is filled, not replaced;
    rows of an earlier, longer A do not leak into a shorter one's result."""
    rng = _rng(2)
    a, b = _fp16_operands(rng, 8, 64, 32)
    ctx = runtime.context(MatmulShape(8, 64, 32, "fp16"))
    bb = ctx.new_b()
    ctx.write_b(bb, b)
    full = ctx.run(a, bb)
    out = np.empty((3, 32), np.float32)
    assert ctx.run(a[:3], bb, out=out) is out
    assert np.array_equal(out, full[:3])
    assert ctx.run(a[5:6], bb).shape == (1, 32)
    with pytest.raises(MatmulError, match="out must be"):
        ctx.run(a[:3], bb, out=np.empty((3, 32), np.float64))


# --- the native layout ------------------------------------------------------------------

@pytest.mark.parametrize("dtype,k,n", [("fp16", 96, 48), ("int8", 64, 96),
                                       ("fp16", SEGMENT_K + 64, 16), ("int8", MAX_K, 32)])
def test_packing_matches_the_librarys_own_converter(runtime, dtype, k, n):
    """Our in-place packer and the library's ``rknn_B_normal_layout_to_native_layout``
    (the stand-in's C here, Rockchip's on a board) give the same bytes, segments past
    K = 8192 included."""
    shape = MatmulShape(1, k, n, dtype)
    rng = _rng(k + n)
    if dtype == "fp16":
        b = rng.standard_normal((k, n)).astype(np.float16)
    else:
        b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    ours = np.zeros(k * n, b.dtype)
    write_native(ours, shape, b, 0, 0)
    theirs = np.zeros(k * n, b.dtype)
    info = matmul_abi.MatmulInfo(M=1, K=k, N=n, type=matmul._TYPES[dtype],
                                 B_layout=matmul_abi.LAYOUT_NATIVE)
    ret = runtime.lib.rknn_B_normal_layout_to_native_layout(
        b.ctypes.data, theirs.ctypes.data, k, n, ctypes.byref(info))
    assert ret == 0
    assert np.array_equal(ours, theirs)
    assert not np.array_equal(ours, b.ravel())  # the layouts differ at all


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_partial_writes_at_offsets(runtime, dtype):
    """The attention's use: B filled block by block (ragged block sizes, in any order, K
    and N offsets), each write leaving the rest of B as it was; then the product is that
    of the whole B. A block one tile off (another offset) gives another B."""
    k, n = SEGMENT_K + 512, 96
    shape = MatmulShape(5, k, n, dtype)
    rng = _rng(3)
    sub_n = 16 if dtype == "fp16" else 32
    if dtype == "fp16":
        want = rng.standard_normal((k, n)).astype(np.float16)
        a = rng.standard_normal((5, k)).astype(np.float16)
    else:
        want = rng.integers(-128, 128, (k, n), dtype=np.int8)
        a = rng.integers(-128, 128, (5, k), dtype=np.int8)
    ctx = runtime.context(shape)
    bb = ctx.new_b()
    assert not bb.normal().any()  # fresh runtime memory is zero
    blocks = [(0, 0, 100, n), (128, 0, 8000, sub_n), (128, sub_n, 8000, n - sub_n),
              (8128, 0, 320, sub_n + 5), (8128, 2 * sub_n, 320, n - 2 * sub_n),
              (8448, 0, 250, n)]
    expected = np.zeros_like(want)
    for row, col, rows, cols in blocks[::-1]:
        ctx.write_b(bb, want[row:row + rows, col:col + cols], row, col)
        expected[row:row + rows, col:col + cols] = want[row:row + rows, col:col + cols]
        assert np.array_equal(bb.normal(), expected)
    with pytest.raises(MatmulError, match="multiple of 32"):
        ctx.write_b(bb, want[100:128], 100, 0)
    assert not expected[100:128].any() and not expected[8698:].any()  # never written
    assert np.array_equal(bb.normal(), expected)
    c = ctx.run(a, bb)
    ref = _exact(a, expected)
    if dtype == "int8":
        assert np.array_equal(c, ref)
    else:
        assert np.all(np.abs(c - ref) <= _fp16_bound(a, expected))
    ctx.write_b(bb, want[8448:8448 + 32], 8448 + 32, 0)  # one tile too far down
    moved = ctx.run(a, bb)
    assert not np.array_equal(moved, c)


def test_a_normal_layout_b_gives_wrong_products(runtime):
    """The library reads B natively: B's bytes in the normal layout (no packing) give
    other products, so a binding that forgot to pack would fail the tests above."""
    rng = _rng(4)
    a = rng.integers(-128, 128, (4, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (64, 64), dtype=np.int8)
    ctx = runtime.context(MatmulShape(4, 64, 64, "int8"))
    bb = ctx.new_b()
    bb.values[:] = b.ravel()
    assert not np.array_equal(ctx.run(a, bb), _exact(a, b))


def test_write_b_refuses_bad_blocks(runtime):
    ctx = runtime.context(MatmulShape(2, 64, 64, "int8"))
    bb = ctx.new_b()
    block = np.ones((32, 32), np.int8)
    with pytest.raises(MatmulError, match="column multiple of 32"):
        ctx.write_b(bb, block, 0, 16)
    with pytest.raises(MatmulError, match="outside"):
        ctx.write_b(bb, block, 64, 0)
    with pytest.raises(MatmulError, match="outside"):
        ctx.write_b(bb, np.ones((32, 64), np.int8), 0, 32)
    with pytest.raises(MatmulError, match="int8"):
        ctx.write_b(bb, block.astype(np.int32), 0, 0)
    with pytest.raises(MatmulError, match="2-D"):
        ctx.write_b(bb, np.ones(32, np.int8), 0, 0)
    assert not bb.normal().any()


# --- limits -----------------------------------------------------------------------------

LO, HI = FP16_ABORT_RANGE
REFUSED = [
    MatmulShape(4, MAX_K + 32, 32, "int8"),  # K past the runtime's limit
    MatmulShape(4, 48, 32, "int8"),  # K not a multiple of 32
    MatmulShape(4, 64, 48, "int8"),  # int8 N not a multiple of 32
    MatmulShape(4, 64, 40, "fp16"),  # fp16 N not a multiple of 16
    MatmulShape(4, 80, 16, "fp16"),  # fp16 K not a multiple of 32
    MatmulShape(0, 64, 32, "int8"),  # no rows
    MatmulShape(4, 0, 32, "int8"),
    MatmulShape(4, 64, 0, "fp16"),
    MatmulShape((DOMAIN_BYTES // 8192) + 1, 8192, 32, "int8"),  # A alone past 4 GB
    MatmulShape(4, 64, 32, "int4"),  # type: ignore[arg-type]
]
ABORTS = [MatmulShape(1, 32, LO, "fp16"), MatmulShape(1, 32, HI, "fp16"),
          MatmulShape(1, 32, LO + 1024, "fp16")]


@pytest.mark.parametrize("shape", REFUSED + ABORTS, ids=str)
def test_plan_limits_are_refused_before_the_library(runtime, shape):
    with pytest.raises(MatmulError):
        check_shape(shape)
    with pytest.raises(MatmulError):
        runtime.context(shape)


def _raw_create(lib: ctypes.CDLL, shape: MatmulShape) -> int:
    """``rknn_matmul_create`` called directly, as a binding without the plan check would."""
    handle = matmul_abi.Context(0)
    io = matmul_abi.MatmulIoAttr()
    info = matmul_abi.MatmulInfo(M=shape.m, K=shape.k, N=shape.n,
                                 type=matmul._TYPES.get(shape.dtype, 7),
                                 B_layout=matmul_abi.LAYOUT_NATIVE)
    ret = lib.rknn_matmul_create(ctypes.byref(handle), ctypes.byref(info), ctypes.byref(io))
    if ret == 0:
        lib.rknn_matmul_destroy(handle)
    return ret


@pytest.mark.parametrize("shape", REFUSED, ids=str)
def test_the_stand_in_refuses_what_the_plan_refuses(runtime, shape):
    """So a plan check that let a shape through would fail at create in every test."""
    assert _raw_create(runtime.lib, shape) < 0


def test_the_stand_in_accepts_the_plans_edges(runtime):
    for shape in (MatmulShape(1, MAX_K, 32, "int8"), MatmulShape(1, 32, 16, "fp16"),
                  MatmulShape(1, 32, LO - 16, "fp16"), MatmulShape(1, 32, HI + 16, "fp16"),
                  MatmulShape(1, MAX_K, 16, "fp16")):
        check_shape(shape)
        assert _raw_create(runtime.lib, shape) == 0, shape


@pytest.mark.parametrize("shape", ABORTS, ids=str)
def test_the_stand_in_aborts_where_librknnrt_aborts(runtime, shape):
    """fp16 with N in [16384, 18432] kills the process inside librknnrt; the stand-in does
    the same (in a child process here), so no test can pass through such a shape."""
    code = ("import ctypes, sys; from pathlib import Path; "
            "from ling3_rknn.npu import matmul, matmul_abi as abi; "
            "lib = matmul.RknnMatmulRuntime(Path(sys.argv[1]), 'x').lib; "
            "h, io = abi.Context(0), abi.MatmulIoAttr(); "
            f"info = abi.MatmulInfo(M=1, K={shape.k}, N={shape.n}, type=1, B_layout=1); "
            "print(lib.rknn_matmul_create(ctypes.byref(h), ctypes.byref(info), "
            "ctypes.byref(io)))")
    out = subprocess.run([sys.executable, "-c", code, str(runtime.path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -signal.SIGABRT, (out.stdout, out.stderr)
    assert "aborts librknnrt" in out.stderr


def test_the_stand_in_refuses_multi_core_masks(runtime):
    ctx = runtime.context(MatmulShape(1, 32, 32, "int8"))
    for mask in (3, 7, 0xFFFF):
        assert runtime.lib.rknn_matmul_set_core_mask(ctx._handle, mask) < 0
    assert runtime.lib.rknn_matmul_set_core_mask(ctx._handle, 4) == 0


# --- errors and lifetimes ---------------------------------------------------------------

def test_errors_are_typed_and_close_is_safe(runtime):
    shape = MatmulShape(2, 32, 32, "int8")
    ctx = runtime.context(shape)
    other = runtime.context(shape)
    bb, foreign = ctx.new_b(), other.new_b()
    a = np.ones((2, 32), np.int8)
    with pytest.raises(MatmulError, match="another matmul context"):
        ctx.run(a, foreign)
    with pytest.raises(MatmulError, match=r"A must be \[1..2, 32\]"):
        ctx.run(np.ones((3, 32), np.int8), bb)
    with pytest.raises(MatmulError, match="A must be int8"):
        ctx.run(a.astype(np.float32), bb)
    bb.free()
    bb.free()
    with pytest.raises(MatmulError, match="freed"):
        ctx.run(a, bb)
    bb2 = ctx.new_b()
    ctx.close()
    ctx.close()
    bb2.free()  # after the context: nothing left to free, no error
    assert bb2.freed and bb2.values.size == 0
    with pytest.raises(MatmulError, match="closed"):
        ctx.run(a, bb2)
    with pytest.raises(MatmulError, match="closed"):
        ctx.new_b()
    with pytest.raises(MatmulError, match="core 3"):
        runtime.context(shape, core=3)
    with pytest.raises(MatmulError, match="domain -1"):
        runtime.context(shape, domain=-1)
    runtime.close()
    assert other.closed and foreign.freed
    with pytest.raises(MatmulError, match="closed"):
        runtime.context(shape)


def test_library_errors_are_matmul_errors(runtime):
    """A code from the library (here a domain the stand-in has not got) is a MatmulError
    naming the call and the code."""
    with pytest.raises(MatmulError, match=r"rknn_matmul_create .*RKNN_ERR_PARAM_INVALID"):
        runtime.context(MatmulShape(1, 32, 32, "int8"), domain=99)


def test_contexts_on_every_core_and_domain_run_in_parallel(runtime):
    rng = _rng(5)
    shape = MatmulShape(32, 512, 96, "int8")
    jobs = []
    for core in range(3):
        ctx = runtime.context(shape, core=core, domain=core)
        a = rng.integers(-128, 128, (32, 512), dtype=np.int8)
        b = rng.integers(-128, 128, (512, 96), dtype=np.int8)
        bb = ctx.new_b()
        ctx.write_b(bb, b)
        jobs.append((ctx, a, bb, _exact(a, b)))
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        ctx, a, bb, want = jobs[i]
        results[i] = all(np.array_equal(ctx.run(a, bb), want) for _ in range(5))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True}
    assert [(c.core, c.domain) for c, *_ in jobs] == [(0, 0), (1, 1), (2, 2)]


def test_switching_b_between_runs(runtime):
    """Two Bs on one context: each run uses the B it is given."""
    rng = _rng(6)
    ctx = runtime.context(MatmulShape(3, 64, 32, "int8"))
    a = rng.integers(-128, 128, (3, 64), dtype=np.int8)
    pairs = []
    for _ in range(2):
        b = rng.integers(-128, 128, (64, 32), dtype=np.int8)
        bb = ctx.new_b()
        ctx.write_b(bb, b)
        pairs.append((bb, _exact(a, b)))
    for bb, want in pairs + pairs[::-1]:
        assert np.array_equal(ctx.run(a, bb), want)


# --- dynamic M (rknn_matmul_create_dynamic_shape) ---------------------------------------

def rows_run(runtime, ctx) -> int:
    """The stand-in's count of rows its runs computed on ``ctx`` (the sum of M)."""
    fn = runtime.lib.ling3_standin_rows_run
    fn.restype, fn.argtypes = ctypes.c_int64, [matmul_abi.Context]
    return int(fn(ctx.handle))


@pytest.mark.parametrize("dtype", ["int8", "fp16"])
def test_dynamic_context_runs_the_smallest_declared_m(runtime, dtype):
    """One context, one B written once: each run computes the smallest declared M that
    holds A's rows (the library's count says so), the products those of A's rows, in any
    order of M, the B switched between shapes too."""
    rng = _rng(7)
    k, n = 96, 64
    ctx = runtime.context(MatmulShape(64, k, n, dtype), rows=(64, 16, 32))
    assert ctx.rows == (16, 32, 64) and ctx.m == 64 and "M in (16, 32, 64)" in repr(ctx)
    if dtype == "int8":
        a = rng.integers(-128, 128, (64, k), dtype=np.int8)
        bs = [rng.integers(-128, 128, (k, n), dtype=np.int8) for _ in range(2)]
    else:
        a, b0 = _fp16_operands(rng, 64, k, n)
        bs = [b0, rng.standard_normal((k, n)).astype(np.float16)]
    held = []
    for b in bs:
        held.append(ctx.new_b())
        ctx.write_b(held[-1], b)
    computed = 0
    for rows, m, which in [(5, 16, 0), (16, 16, 1), (17, 32, 1), (64, 64, 0), (1, 16, 0),
                           (33, 64, 1), (32, 32, 0)]:
        c = ctx.run(a[:rows], held[which])
        computed += m
        assert ctx.m == m and rows_run(runtime, ctx) == computed
        want = _exact(a[:rows], bs[which])
        if dtype == "int8":
            assert np.array_equal(c, want)
        else:
            assert np.all(np.abs(c - want) <= _fp16_bound(a[:rows], bs[which]))
    ctx.rerun()  # the library call alone, at the M of the last run
    assert rows_run(runtime, ctx) == computed + 32
    with pytest.raises(MatmulError, match=r"A must be \[1..64"):
        ctx.run(np.zeros((65, k), a.dtype), held[0])


def test_a_static_context_computes_all_m(runtime):
    """The reason for the dynamic form: a static context's run computes every row."""
    ctx = runtime.context(MatmulShape(64, 32, 32, "int8"))
    bb = ctx.new_b()
    ctx.run(np.ones((5, 32), np.int8), bb)
    assert ctx.rows == () and ctx.m == 64 and rows_run(runtime, ctx) == 64


def test_dynamic_rows_are_checked_at_plan_time(runtime, monkeypatch):
    shape = MatmulShape(64, 64, 32, "int8")
    for rows, match in [((16, 32), "largest being m = 64"), ((16, 16, 64), "distinct"),
                        ((0, 64), "m must be at least 1")]:
        with pytest.raises(MatmulError, match=match):
            runtime.context(shape, rows=rows)
    # a declared M whose A + B + C overflow the domain is refused like a static shape
    big = MatmulShape(1 << 20, 1024, 1024, "int8")
    with pytest.raises(MatmulError, match="4 GB"):
        runtime.context(big, rows=(16, big.m))
    monkeypatch.setattr(matmul_abi, "has_dynamic", lambda lib: False)
    with pytest.raises(MatmulError, match="lacks rknn_matmul_create_dynamic_shape"):
        runtime.context(shape, rows=(16, 64))
    assert runtime.context(shape).rows == ()  # static contexts still run


def _raw_dynamic(lib, ms, k=64, n=32, ks=None):
    count = len(ms)
    shapes = (matmul_abi.DynamicShape * count)(
        *(matmul_abi.DynamicShape(M=m, K=(ks or [k] * count)[i], N=n) for i, m in enumerate(ms)))
    ios = (matmul_abi.MatmulIoAttr * count)()
    info = matmul_abi.MatmulInfo(type=matmul_abi.INT8_MM_INT8_TO_INT32,
                                 B_layout=matmul_abi.LAYOUT_NATIVE)
    handle = matmul_abi.Context(0)
    ret = lib.rknn_matmul_create_dynamic_shape(ctypes.byref(handle), ctypes.byref(info), count,
                                               shapes, ios)
    return ret, handle, shapes, ios


def test_the_stand_in_keeps_the_dynamic_rules(runtime):
    """Shapes sharing K and N, distinct M; only a declared shape is set; A and C are set
    after set_dynamic_shape and again after every change, B stays set."""
    lib = runtime.lib
    assert _raw_dynamic(lib, [16, 32], ks=[64, 96])[0] == -5  # K differs
    assert _raw_dynamic(lib, [16, 16])[0] == -5
    assert _raw_dynamic(lib, [16, 32], k=48)[0] == -5  # K % 32
    ret, h, shapes, ios = _raw_dynamic(lib, [16, 32])
    assert ret == 0
    try:
        assert [tuple(io.A.shape) for io in ios] == [(16, 64), (32, 64)]
        assert ios[0].B.shape == ios[1].B.shape == (1, 2, 32, 32)
        mems = [lib.rknn_create_mem(h, ios[1].A.size), lib.rknn_create_mem(h, ios[1].B.size),
                lib.rknn_create_mem(h, ios[1].C.size)]
        assert lib.rknn_matmul_set_io_mem(h, mems[0], ctypes.byref(ios[1].A)) == -5  # no shape
        other = matmul_abi.DynamicShape(M=8, K=64, N=32)
        assert lib.rknn_matmul_set_dynamic_shape(h, ctypes.byref(other)) == -5
        assert lib.rknn_matmul_set_dynamic_shape(h, ctypes.byref(shapes[1])) == 0
        for mem, attr in zip(mems, (ios[1].A, ios[1].B, ios[1].C), strict=True):
            assert lib.rknn_matmul_set_io_mem(h, mem, ctypes.byref(attr)) == 0
        assert lib.rknn_matmul_run(h) == 0
        assert lib.rknn_matmul_set_dynamic_shape(h, ctypes.byref(shapes[0])) == 0
        assert lib.rknn_matmul_run(h) == -8  # A and C not set again
        assert lib.rknn_matmul_set_io_mem(h, mems[0], ctypes.byref(ios[0].A)) == 0
        assert lib.rknn_matmul_set_io_mem(h, mems[2], ctypes.byref(ios[0].C)) == 0
        assert lib.rknn_matmul_run(h) == 0  # B kept
    finally:
        assert lib.rknn_matmul_destroy(h) == 0
    static = matmul_abi.Context(0)
    io = matmul_abi.MatmulIoAttr()
    info = matmul_abi.MatmulInfo(M=16, K=64, N=32, type=matmul_abi.INT8_MM_INT8_TO_INT32,
                                 B_layout=matmul_abi.LAYOUT_NATIVE)
    assert lib.rknn_matmul_create(ctypes.byref(static), ctypes.byref(info), ctypes.byref(io)) == 0
    assert lib.rknn_matmul_set_dynamic_shape(static, ctypes.byref(shapes[0])) == -5
    lib.rknn_matmul_destroy(static)


# --- which library ----------------------------------------------------------------------

def test_library_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(matmul, "LIBRKNNRT", tmp_path / "librknnrt.so")
    monkeypatch.setenv(RUNTIME_ENV, "mock")
    assert matmul.resolve_library()[0] == "stand-in"
    monkeypatch.setenv(RUNTIME_ENV, "auto")
    assert matmul.resolve_library()[0] == "stand-in"  # no librknnrt here
    with pytest.raises(MatmulError, match=r"librknnrt\.so is missing"):
        matmul.resolve_library("board")
    with pytest.raises(MatmulError, match="unknown NPU runtime 'gpu'"):
        matmul.resolve_library("gpu")
    (tmp_path / "librknnrt.so").write_bytes(b"")
    assert matmul.resolve_library("auto") == ("librknnrt", tmp_path / "librknnrt.so")
    assert matmul.resolve_library("board")[0] == "librknnrt"
    with pytest.raises(MatmulError, match="cannot load the matmul API"):
        matmul.open_runtime("board")  # an empty file is no library


def test_a_missing_or_stale_stand_in_says_how_to_build_it(tmp_path):
    with pytest.raises(MatmulError, match=r"not built.*build-kernels"):
        matmul_standin_build.library_path(tmp_path)
    session = matmul_standin_build.library_path().parent
    for name in (matmul_standin_build.LIBRARY, matmul_standin_build.MANIFEST):
        (tmp_path / name).write_bytes((session / name).read_bytes())
    assert matmul_standin_build.library_path(tmp_path) == tmp_path / "ling3-rknnrt-standin.so"
    manifest = tmp_path / matmul_standin_build.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "sources": "0" * 16}))
    with pytest.raises(MatmulError, match=r"other sources.*build-kernels"):
        matmul_standin_build.library_path(tmp_path)


def test_build_kernels_builds_the_stand_in(tmp_path):
    """``ling3-rknn build-kernels`` puts the stand-in beside the kernels, loadable."""
    native_build.build(tmp_path)
    path = matmul_standin_build.library_path(tmp_path)
    rt = matmul.RknnMatmulRuntime(path, "stand-in")
    try:
        ctx = rt.context(MatmulShape(1, 32, 32, "int8"))
        bb = ctx.new_b()
        ctx.write_b(bb, np.eye(32, dtype=np.int8))
        assert np.array_equal(ctx.run(np.arange(32, dtype=np.int8)[None], bb),
                              np.arange(32)[None])
    finally:
        rt.close()


# --- the bench's microbenchmarks --------------------------------------------------------

def test_bench_times_the_prefill_plans_shapes(monkeypatch):
    from ling3_rknn.bench import npu_matmul

    shapes = npu_matmul.plan_shapes()
    assert shapes["attn_qk"] == MatmulShape(1024, 192, 2048, "fp16")  # mla_npu.py's
    assert shapes["attn_pv"] == MatmulShape(1024, 2048, 128, "fp16")
    assert shapes["attn_queries"] == MatmulShape(1024, 512, 128, "fp16")  # U_h, per head
    assert shapes["attn_latents"] == MatmulShape(1024, 128, 512, "fp16")  # V_h^T, per head
    assert shapes["attn_rows"] == MatmulShape(1024, 512, 16 * 256, "fp16")  # [U | V]
    for m in (16, 32, 64, 128, 256):
        assert shapes[f"expert_gate_up_m{m}"] == MatmulShape(m, 1536, 1024, "int8")
        assert shapes[f"expert_down_m{m}"] == MatmulShape(m, 512, 1536, "int8")
    for shape in shapes.values():
        check_shape(shape)
    monkeypatch.setenv(RUNTIME_ENV, "mock")
    assert npu_matmul.dynamic_shapes() == {
        "expert_gate_up": MatmulShape(256, 1536, 1024, "int8"),
        "expert_down": MatmulShape(256, 512, 1536, "int8")}
    monkeypatch.setattr(npu_matmul, "plan_shapes", lambda: {
        "fixed": MatmulShape(1, 32, 32, "int8"), "bad": MatmulShape(1, 48, 32, "int8")})
    monkeypatch.setattr(npu_matmul, "dynamic_shapes", lambda: {
        "small": MatmulShape(64, 64, 32, "int8"), "bad": MatmulShape(64, 48, 32, "int8")})
    figures = npu_matmul.measure(runs=2)
    assert figures["runtime"] == "stand-in"
    assert figures["shapes"]["fixed"]["us_per_run"] > 0
    assert "multiple of 32" in figures["shapes"]["bad"]["error"]
    dynamic = figures["dynamic"]
    assert set(dynamic) == {"small_m16", "small_m32", "small_m64", "bad"}
    assert dynamic["small_m16"]["shape"] == "int8 16x64x32 (dynamic, M in (16, 32, 64))"
    assert dynamic["small_m16"]["switch_us_per_run"] > 0
    assert all(dynamic[f"small_m{m}"]["npu_us_per_run"] > 0 for m in (16, 32, 64))
    assert "multiple of 32" in dynamic["bad"]["error"]
    text = "\n".join(npu_matmul.summary_lines(figures))
    assert "host stand-in: not NPU figures" in text and "bad" in text and "failed" in text
    assert "dynamic-M" in text and "small_m16" in text and "after M = 64" in text
    monkeypatch.setenv(RUNTIME_ENV, "gpu")
    assert npu_matmul.measure(runs=2)["runtime"] is None
    assert "not measured" in npu_matmul.summary_lines(npu_matmul.measure(runs=2))[0]


def test_a_context_holds_the_buffers_a_long_prompt_needs(runtime):
    """The prefill attention keeps 2 B per head and 2048-row piece on each core's context
    (hundreds at 32K tokens), the experts' store hundreds per context: the stand-in must not
    refuse them where the board would not."""
    ctx = runtime.context(MatmulShape(1, 32, 32, "int8"))
    bs = [ctx.new_b() for _ in range(700)]
    ctx.write_b(bs[-1], np.eye(32, dtype=np.int8))
    assert np.array_equal(ctx.run(np.arange(32, dtype=np.int8)[None], bs[-1]),
                          np.arange(32)[None])
    for b in bs:
        b.free()

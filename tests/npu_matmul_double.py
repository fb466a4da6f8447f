"""A numpy stand-in for the NPU matmul runtime's interface (``npu/matmul_plan.py``), for
tests of the code above it: exact float32 products of float16 inputs (11-bit significands:
a product is exact in float32) summed in float32, exact int32 for int8. B is kept in the
normal layout; the C stand-in library tests the native layouts (tests/test_npu_matmul.py).
Counts runs and live B operands, so a test can see what crossed to the NPU and what leaked."""

from __future__ import annotations

import numpy as np

from ling3_rknn.npu.matmul_plan import MatmulError, MatmulShape, check_shape


class DoubleB:
    def __init__(self, ctx: DoubleContext) -> None:
        s = ctx.shape
        self.values = np.full((s.k, s.n), np.nan if s.dtype == "fp16" else 0,
                              dtype=np.float16 if s.dtype == "fp16" else np.int8)
        self.ctx = ctx
        self.freed = False
        ctx.runtime.live_b += 1

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self.ctx.runtime.live_b -= 1


class DoubleContext:
    def __init__(self, runtime: DoubleRuntime, shape: MatmulShape, core: int,
                 rows: tuple[int, ...] = ()) -> None:
        check_shape(shape)
        self.runtime, self.shape, self.core = runtime, shape, core
        self.rows = tuple(sorted(rows)) or (shape.m,)  # the M it runs at (dynamic shapes)
        self.closed = False

    def new_b(self) -> DoubleB:
        return DoubleB(self)

    def write_b(self, b: DoubleB, values: np.ndarray, row: int = 0, col: int = 0) -> None:
        k_align, n_align = (32, 16) if self.shape.dtype == "fp16" else (32, 32)
        if b.ctx is not self or b.freed:
            raise MatmulError("B of another context, or freed")
        if row % k_align or col % n_align:
            raise MatmulError(f"unaligned write at ({row}, {col})")
        k, n = values.shape
        if row + k > self.shape.k or col + n > self.shape.n:
            raise MatmulError("write past B")
        b.values[row:row + k, col:col + n] = values

    def run(self, a: np.ndarray, b: DoubleB) -> np.ndarray:
        s = self.shape
        if self.closed or b.freed or b.ctx is not self:
            raise MatmulError("run on a closed context or a foreign / freed B")
        if not 1 <= a.shape[0] <= s.m or a.shape[1] != s.k or a.dtype != s.a_dtype:
            raise MatmulError(f"A must be {s.a_dtype} [1..{s.m}, {s.k}], got {a.dtype} "
                              f"{a.shape}")
        m = next(r for r in self.rows if r >= a.shape[0])  # the M the NPU would compute
        self.runtime.runs.append(MatmulShape(m, s.k, s.n, s.dtype))
        if s.dtype == "fp16":
            return a.astype(np.float32) @ b.values.astype(np.float32)
        return a.astype(np.int32) @ b.values.astype(np.int32)

    def close(self) -> None:
        self.closed = True


class DoubleRuntime:
    name = "numpy double"

    def __init__(self) -> None:
        self.runs: list[MatmulShape] = []
        self.live_b = 0
        self.contexts: list[DoubleContext] = []

    def context(self, shape: MatmulShape, *, core: int = 0, domain: int = 0,
                rows: tuple[int, ...] = ()) -> DoubleContext:
        ctx = DoubleContext(self, shape, core, tuple(rows))
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()

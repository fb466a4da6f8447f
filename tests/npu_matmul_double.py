"""A numpy test double of the NPU matmul runtime (``ling3_rknn.npu.matmul_plan``'s
Protocols), for tests of the code above it (the prefill attention, the experts' executor).

Its arithmetic: float32 products of float16 inputs (11-bit significands: a product is exact
in float32) summed in float32; exact int32 for int8 (summed in int64, then checked to fit
int32 as the NPU's C does). The plan's shape checks at create (every declared M of a
dynamic context too), B owned by its context and kept in the normal layout (the C
stand-in tests the native layouts: tests/test_npu_matmul.py), a float16 B born NaN (a row
nobody wrote must not pass unseen), aligned writes only. It records every run (``Run``: the
M the NPU would compute, the smallest declared M >= A's rows, all m for a static context;
k, n, core, domain), the live B operands and the B bytes per IOMMU domain, so a test can
see what crossed to the NPU, how the work was spread and what leaked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ling3_rknn.npu.matmul_plan import (
    ALIGN,
    DOMAIN_BYTES,
    MatmulError,
    MatmulShape,
    check_shape,
    declared_rows,
)


class Run(NamedTuple):
    m: int
    k: int
    n: int
    core: int
    domain: int


class DoubleB:
    def __init__(self, ctx: DoubleContext) -> None:
        s = ctx.shape
        self.values = np.full((s.k, s.n), np.nan if s.dtype == "fp16" else 0, s.a_dtype)
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
    def __init__(self, runtime: DoubleRuntime, shape: MatmulShape, core: int, domain: int,
                 rows: Sequence[int] = ()) -> None:
        check_shape(shape)
        self.rows = declared_rows(shape, rows)
        self.runtime, self.shape, self.core, self.domain = runtime, shape, core, domain
        self.closed = False

    def new_b(self) -> DoubleB:
        nbytes = self.shape.b_bytes
        used = self.runtime.domain_bytes.get(self.domain, 0) + nbytes
        if used > self.runtime.domain_limit:
            raise MatmulError(f"domain {self.domain} is full")
        self.runtime.domain_bytes[self.domain] = used
        return DoubleB(self)

    def write_b(self, b: DoubleB, values: np.ndarray, row: int = 0, col: int = 0) -> None:
        k_align, n_align = ALIGN[self.shape.dtype]
        if b.ctx is not self or b.freed:
            raise MatmulError("B of another context, or freed")
        if values.dtype != self.shape.a_dtype:
            raise MatmulError(f"B must be {self.shape.a_dtype}, got {values.dtype}")
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
        if a.dtype != s.a_dtype or a.ndim != 2 or a.shape[1] != s.k or not 1 <= len(a) <= s.m:
            raise MatmulError(f"{s}: A must be {s.a_dtype} [1..{s.m}, {s.k}], got {a.dtype} "
                              f"{a.shape}")
        m = next((r for r in self.rows if r >= len(a)), s.m)
        self.runtime.runs.append(Run(m, s.k, s.n, self.core, self.domain))
        if s.dtype == "fp16":
            return a.astype(np.float32) @ b.values.astype(np.float32)
        c = a.astype(np.int64) @ b.values.astype(np.int64)
        assert np.abs(c).max(initial=0) < 2**31
        return c.astype(np.int32)

    def close(self) -> None:
        self.closed = True


class DoubleRuntime:
    name = "numpy double"

    def __init__(self, domain_limit: int = DOMAIN_BYTES) -> None:
        self.domain_limit = domain_limit
        self.domain_bytes: dict[int, int] = {}
        self.contexts: list[DoubleContext] = []
        self.runs: list[Run] = []
        self.live_b = 0

    def context(self, shape: MatmulShape, *, core: int = 0, domain: int = 0,
                rows: Sequence[int] = ()) -> DoubleContext:
        ctx = DoubleContext(self, shape, core, domain, rows)
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()

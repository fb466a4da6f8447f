"""A numpy test double of the NPU matmul runtime (``ling3_rknn.npu.matmul_plan``'s
Protocols): exact int32 products for int8, the plan's shape checks at create (every
declared M of a dynamic context too), B owned by its context, and a record of every run
(the M the NPU would compute: the smallest declared M >= A's rows, all m for a static
context; core, domain) and of the B bytes per IOMMU domain, so tests can see how the
executor spread and cut its work."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ling3_rknn.npu.matmul_plan import (
    DOMAIN_BYTES,
    MatmulError,
    MatmulShape,
    check_shape,
    declared_rows,
)


class DoubleB:
    def __init__(self, ctx: DoubleContext) -> None:
        self.ctx = ctx
        self.values = np.zeros((ctx.shape.k, ctx.shape.n), ctx.shape.a_dtype)
        self.freed = False

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def free(self) -> None:
        self.freed = True


class DoubleContext:
    def __init__(self, runtime: DoubleRuntime, shape: MatmulShape, core: int, domain: int,
                 rows: Sequence[int] = ()) -> None:
        check_shape(shape)
        self.rows = declared_rows(shape, rows)
        self.runtime, self.shape, self.core, self.domain = runtime, shape, core, domain
        self.closed = False

    def new_b(self) -> DoubleB:
        b = DoubleB(self)
        used = self.runtime.domain_bytes.get(self.domain, 0) + b.nbytes
        if used > self.runtime.domain_limit:
            raise MatmulError(f"domain {self.domain} is full")
        self.runtime.domain_bytes[self.domain] = used
        return b

    def write_b(self, b: DoubleB, values: np.ndarray, row: int = 0, col: int = 0) -> None:
        assert b.ctx is self and not b.freed
        if values.dtype != self.shape.a_dtype:
            raise MatmulError(f"B must be {self.shape.a_dtype}, got {values.dtype}")
        b.values[row:row + values.shape[0], col:col + values.shape[1]] = values

    def run(self, a: np.ndarray, b: DoubleB) -> np.ndarray:
        if self.closed or b.freed or b.ctx is not self:
            raise MatmulError("closed context, freed B or a B of another context")
        s = self.shape
        if a.dtype != s.a_dtype or a.ndim != 2 or a.shape[1] != s.k or not 1 <= len(a) <= s.m:
            raise MatmulError(f"{s}: A must be {s.a_dtype} [1..{s.m}, {s.k}], got {a.dtype} "
                              f"{a.shape}")
        m = next((r for r in self.rows if r >= len(a)), s.m)
        self.runtime.runs.append((m, s.k, s.n, self.core, self.domain))
        # int64 products summed exactly, then checked to fit int32 as the NPU's C does
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
        self.runs: list[tuple[int, int, int, int, int]] = []  # m, k, n, core, domain

    def context(self, shape: MatmulShape, *, core: int = 0, domain: int = 0,
                rows: Sequence[int] = ()) -> DoubleContext:
        ctx = DoubleContext(self, shape, core, domain, rows)
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()

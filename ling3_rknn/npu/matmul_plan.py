"""What one NPU matmul is, and whether librknnrt on an RK3588 can run it.

librknnrt's matmul API (``rknn_matmul_*``, docs/npu-matmul.md) runs C = A x B for one fixed
shape per context, on one NPU core, in one 4 GB IOMMU domain. On RK3588 only the symmetric
types run (fp16 x fp16, int8 x int8: every mixed type fails at create), and some shapes
abort the process inside the library, where no error can be caught. So every shape is
checked here, at plan time, before a context is asked for: a shape that fails here never
reaches the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np

from ling3_rknn.npu.errors import NpuError

MatmulType = Literal["fp16", "int8"]
MATMUL_TYPES: tuple[MatmulType, ...] = ("fp16", "int8")

# K past this is refused by librknnrt (B is split into segments past 8192 and capped here).
MAX_K = 10240
# (K, N) alignment the RK3588 runtime asks for, per type (rknn_matmul_api.h, SDK 2.3.2).
ALIGN: dict[MatmulType, tuple[int, int]] = {"fp16": (32, 16), "int8": (32, 32)}
# fp16 shapes with K or N in this range abort inside librknnrt (uncatchable): never planned.
FP16_ABORT_RANGE = (16384, 18432)
# One context's memory lives in one IOMMU domain of 4 GB.
DOMAIN_BYTES = 4 << 30
NPU_CORES = 3


class MatmulError(NpuError):
    """A matmul shape the NPU cannot run, or a runtime failure of the matmul API."""


_ITEM = {"fp16": (2, 2, 4), "int8": (1, 1, 4)}  # bytes of an A, B and C element


@dataclass(frozen=True)
class MatmulShape:
    """C [m, n] = A [m, k] x B [k, n]: fp16 x fp16 -> float32, int8 x int8 -> int32."""

    m: int
    k: int
    n: int
    dtype: MatmulType

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def a_bytes(self) -> int:
        return self.m * self.k * _ITEM[self.dtype][0]

    @property
    def b_bytes(self) -> int:
        return self.k * self.n * _ITEM[self.dtype][1]

    @property
    def c_bytes(self) -> int:
        return self.m * self.n * _ITEM[self.dtype][2]

    @property
    def a_dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.dtype == "fp16" else np.int8)

    @property
    def c_dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.dtype == "fp16" else np.int32)

    def __str__(self) -> str:
        return f"{self.dtype} {self.m}x{self.k}x{self.n}"


def check_shape(shape: MatmulShape) -> None:
    """Raise ``MatmulError`` naming the first RK3588 limit ``shape`` breaks."""
    if shape.dtype not in MATMUL_TYPES:
        raise MatmulError(f"matmul type {shape.dtype!r}: RK3588 runs only fp16 x fp16 and "
                          "int8 x int8 (mixed types fail at create)")
    for name in ("m", "k", "n"):
        if getattr(shape, name) < 1:
            raise MatmulError(f"{shape}: {name} must be at least 1")
    if shape.k > MAX_K:
        raise MatmulError(f"{shape}: K {shape.k} is over the runtime's limit {MAX_K}")
    k_align, n_align = ALIGN[shape.dtype]
    if shape.k % k_align or shape.n % n_align:
        raise MatmulError(f"{shape}: {shape.dtype} needs K a multiple of {k_align} and N of "
                          f"{n_align}")
    if shape.dtype == "fp16":
        lo, hi = FP16_ABORT_RANGE
        for name in ("k", "n"):
            if lo <= getattr(shape, name) <= hi:
                raise MatmulError(f"{shape}: fp16 with {name.upper()} in [{lo}, {hi}] aborts "
                                  "the process inside librknnrt")
    if shape.a_bytes + shape.b_bytes + shape.c_bytes > DOMAIN_BYTES:
        raise MatmulError(f"{shape}: A, B and C do not fit one 4 GB IOMMU domain")


def declared_rows(shape: MatmulShape, rows: Sequence[int]) -> tuple[int, ...]:
    """``rows`` as a dynamic context's M list: increasing, distinct, the largest ``shape.m``,
    each M a shape ``check_shape`` passes (so every declared shape is checked at plan
    time); () for a static context."""
    if not rows:
        return ()
    ms = tuple(sorted({int(r) for r in rows}))
    if len(ms) != len(rows) or ms[-1] != shape.m:
        raise MatmulError(f"{shape}: dynamic rows {tuple(rows)} must be distinct, the largest "
                          f"being m = {shape.m}")
    for m in ms:
        check_shape(replace(shape, m=m))
    return ms


def padded(size: int, align: int) -> int:
    """``size`` rounded up to a multiple of ``align`` (zero rows / columns pad a matmul
    without changing the products)."""
    return -(-size // align) * align


class MatmulB(Protocol):
    """One B operand held in NPU memory in its context's native layout."""

    @property
    def nbytes(self) -> int: ...

    def free(self) -> None: ...


class MatmulContext(Protocol):
    """One ``rknn_matmul_ctx`` on one NPU core and IOMMU domain: a fixed shape, or one
    shape at several M (``MatmulRuntime.context``'s ``rows``) over the same B buffers."""

    shape: MatmulShape

    def new_b(self) -> MatmulB: ...

    def write_b(self, b: MatmulB, values: np.ndarray, row: int = 0, col: int = 0) -> None:
        """Write ``values`` [k', n'] (normal layout) into B[row:row + k', col:col + n'],
        packing them into the native layout; ``row`` and ``col`` multiples of the K and N
        alignments (the rest of B is left as it was)."""

    def run(self, a: np.ndarray, b: MatmulB) -> np.ndarray:
        """C [rows, n] (float32 for fp16, int32 for int8) for A [rows, k], 1 <= rows <= m,
        and the held ``b``: computed at the smallest declared M >= rows (all m when the
        context was made without ``rows``)."""

    def close(self) -> None: ...


class MatmulRuntime(Protocol):
    """librknnrt's matmul API on a board, or the host stand-in with the same semantics."""

    name: str

    def context(self, shape: MatmulShape, *, core: int = 0, domain: int = 0,
                rows: Sequence[int] = ()) -> MatmulContext:
        """A context for ``shape``; with ``rows`` (``declared_rows``), one that runs at each
        of those M (the largest ``shape.m``) over the same B buffers."""

    def close(self) -> None: ...

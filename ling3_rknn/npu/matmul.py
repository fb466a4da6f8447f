"""librknnrt's matmul API through ctypes: the board's library or the host stand-in.

One :class:`RknnMatmulContext` is one ``rknn_matmul_ctx`` for one shape
(``matmul_plan.MatmulShape``, checked by ``check_shape`` first), pinned to one NPU core
(``rknn_matmul_set_core_mask``) in one IOMMU domain (``rknn_matmul_info.iommu_domain_id``).
Without ``rows`` it is made by ``rknn_matmul_create`` and every run computes all m rows (A
may hold fewer: they are its first rows). With ``rows`` (several M, the largest the
shape's m) it is made by ``rknn_matmul_create_dynamic_shape`` and each run computes the
smallest declared M that holds A's rows (``rknn_matmul_set_dynamic_shape`` when that M
changes), over the same B buffers: B's native layout depends on K and N only.

A and C live in runtime memory made once per context (``rknn_create_mem``) and set once
(``rknn_matmul_set_io_mem``); ``run`` copies A in (casting on the way, no staging array),
runs, and copies C out. Each B (:class:`NativeB`) is its own runtime buffer in the
native layout (``matmul_layout``), written in place block by block; ``run`` sets it as the
context's B only when it differs from the last one run. Every failure is a
``MatmulError``; a context is used by one thread at a time (a lock enforces it), different
contexts on different cores run in parallel (ctypes drops the GIL in the call).

Which library: ``$LING3_NPU_RUNTIME`` (``board`` | ``mock`` | ``auto``, as for the graph
executors in ``executors.py``): ``board`` is ``/usr/lib/librknnrt.so``, ``mock`` the
stand-in built by ``ling3-rknn build-kernels``, ``auto`` the board's library when it is
installed, else the stand-in. docs/npu-matmul.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ling3_rknn.npu import matmul_abi as abi
from ling3_rknn.npu import matmul_standin_build
from ling3_rknn.npu.executors import LIBRKNNRT, RUNTIME_ENV
from ling3_rknn.npu.matmul_layout import native_tile, read_native, write_native
from ling3_rknn.npu.matmul_plan import (
    NPU_CORES,
    MatmulB,
    MatmulError,
    MatmulShape,
    check_shape,
    declared_rows,
)

log = logging.getLogger(__name__)

_TYPES = {"fp16": abi.FLOAT16_MM_FLOAT16_TO_FLOAT32, "int8": abi.INT8_MM_INT8_TO_INT32}
_CORE_MASKS = (1, 2, 4)  # RKNN_NPU_CORE_0 / _1 / _2


def resolve_library(choice: str | None = None) -> tuple[str, Path]:
    """(name, path) of the matmul library to load: ``choice``, else
    ``$LING3_NPU_RUNTIME``, else ``auto`` (the graph executors' rule)."""
    choice = choice or os.environ.get(RUNTIME_ENV) or "auto"
    if choice == "mock":
        return "stand-in", matmul_standin_build.library_path()
    if choice not in ("board", "auto"):
        raise MatmulError(f"unknown NPU runtime {choice!r}; use board, mock or auto")
    if LIBRKNNRT.exists():
        return "librknnrt", LIBRKNNRT
    if choice == "board":
        raise MatmulError(f"{LIBRKNNRT} is missing: the NPU matmuls need Rockchip's runtime "
                          "library (docs/board-guide.md section 2)")
    if platform.machine() in ("aarch64", "armv7l"):
        log.warning("%s is missing on %s: NPU matmuls run on the host stand-in",
                    LIBRKNNRT, platform.machine())
    return "stand-in", matmul_standin_build.library_path()


def open_runtime(choice: str | None = None) -> RknnMatmulRuntime:
    """The matmul runtime ``resolve_library(choice)`` names, loaded."""
    name, path = resolve_library(choice)
    return RknnMatmulRuntime(path, name)


class RknnMatmulRuntime:
    """One loaded matmul library (``MatmulRuntime``); closing it closes its contexts."""

    def __init__(self, library: Path, name: str = "librknnrt") -> None:
        self.name = name
        self.path = library
        try:
            self.lib = abi.bind(ctypes.CDLL(str(library)))
        except (OSError, AttributeError) as exc:
            raise MatmulError(f"cannot load the matmul API from {library}: {exc}") from exc
        self._contexts: list[RknnMatmulContext] = []
        self._lock = threading.Lock()
        self._closed = False

    def context(self, shape: MatmulShape, *, core: int = 0, domain: int = 0,
                rows: Sequence[int] = ()) -> RknnMatmulContext:
        with self._lock:
            if self._closed:
                raise MatmulError(f"the {self.name} matmul runtime is closed")
            ctx = RknnMatmulContext(self, shape, core=core, domain=domain, rows=rows)
            self._contexts = [c for c in self._contexts if not c.closed] + [ctx]
            return ctx

    def close(self) -> None:
        with self._lock:
            self._closed = True
            contexts, self._contexts = self._contexts, []
        for ctx in contexts:
            ctx.close()

    def __repr__(self) -> str:
        return f"RknnMatmulRuntime({self.name}, {self.path})"


def _view(mem: abi.TensorMem, dtype: np.dtype, count: int) -> np.ndarray:
    """``count`` elements of runtime memory as a writable numpy array (no copy)."""
    if not mem.virt_addr or mem.size < count * dtype.itemsize:
        raise MatmulError(f"runtime memory of {mem.size} bytes cannot hold {count} "
                          f"{dtype} values")
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(mem.virt_addr)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype)


class NativeB:
    """One B operand in runtime memory, in its context's native layout (``MatmulB``)."""

    def __init__(self, context: RknnMatmulContext, mem: ctypes._Pointer) -> None:
        self.context = context
        self._mem: ctypes._Pointer | None = mem
        self.nbytes = int(mem.contents.size)
        self.values = _view(mem.contents, context.shape.a_dtype,
                            context.shape.k * context.shape.n)

    @property
    def freed(self) -> bool:
        return self._mem is None

    def free(self) -> None:
        """Give the memory back (safe twice, and after the context closed)."""
        self.context._free_b(self)

    def normal(self) -> np.ndarray:
        """B [k, n] in the normal layout (a copy; for checks, not the hot path)."""
        with self.context._lock:
            self.context._check_b(self)
            return read_native(self.values, self.context.shape)


class RknnMatmulContext:
    """One ``rknn_matmul_ctx`` (``MatmulContext``) on one core and domain: a fixed shape, or
    (``rows``) the shape at each of several M over the same B buffers."""

    def __init__(self, runtime: RknnMatmulRuntime, shape: MatmulShape, *, core: int = 0,
                 domain: int = 0, rows: Sequence[int] = ()) -> None:
        check_shape(shape)
        self.rows = declared_rows(shape, rows)
        if self.rows and not abi.has_dynamic(runtime.lib):
            raise MatmulError(f"{runtime.name} ({runtime.path}) lacks "
                              "rknn_matmul_create_dynamic_shape: dynamic M needs librknnrt "
                              "of SDK 2.3.2 (docs/npu-matmul.md)")
        if not 0 <= core < NPU_CORES:
            raise MatmulError(f"NPU core {core}: the RK3588 has cores 0..{NPU_CORES - 1}")
        if domain < 0:
            raise MatmulError(f"IOMMU domain {domain} must be at least 0")
        self.shape = shape
        self.core = core
        self.domain = domain
        self.runtime_name = runtime.name
        self._lib = runtime.lib
        self._lock = threading.Lock()
        self._bs: list[NativeB] = []
        self._current_b: NativeB | None = None
        self._handle = abi.Context(0)
        self.io = abi.MatmulIoAttr()
        # the M the next run computes (None: unknown after a failed shape change)
        self._m: int | None = shape.m
        info = abi.MatmulInfo(M=shape.m, K=shape.k, N=shape.n, type=_TYPES[shape.dtype],
                              B_layout=abi.LAYOUT_NATIVE, AC_layout=abi.LAYOUT_NORM,
                              iommu_domain_id=domain)
        # per declared M (one entry, the shape itself, for a static context)
        count = max(len(self.rows), 1)
        self._dyn = (abi.DynamicShape * count)(
            *(abi.DynamicShape(M=m, K=shape.k, N=shape.n) for m in self.rows or (shape.m,)))
        self._ios = (abi.MatmulIoAttr * count)()
        if self.rows:
            # info's M, K and N are ignored by this call (the header); set to the largest
            self._call("rknn_matmul_create_dynamic_shape",
                       self._lib.rknn_matmul_create_dynamic_shape(
                           ctypes.byref(self._handle), ctypes.byref(info), count, self._dyn,
                           self._ios))
        else:
            self._call("rknn_matmul_create", self._lib.rknn_matmul_create(
                ctypes.byref(self._handle), ctypes.byref(info), ctypes.byref(self._ios[0])))
        self.io = self._ios[count - 1]  # the largest M's: A and C are sized by it
        self._io_now = self.io  # the attributes of the M in effect
        self._a_mem: ctypes._Pointer | None = None
        self._c_mem: ctypes._Pointer | None = None
        try:
            self._call("rknn_matmul_set_core_mask",
                       self._lib.rknn_matmul_set_core_mask(self._handle, _CORE_MASKS[core]))
            self._check_attrs()
            self._a_mem = self._create_mem(max(io.A.size for io in self._ios))
            self._c_mem = self._create_mem(max(io.C.size for io in self._ios))
            self._a = _view(self._a_mem.contents, shape.a_dtype,
                            shape.m * shape.k).reshape(shape.m, shape.k)
            self._c = _view(self._c_mem.contents, shape.c_dtype,
                            shape.m * shape.n).reshape(shape.m, shape.n)
            if self.rows:
                self._m = None
                self._select(shape.m)
            else:
                self._set_io(self._a_mem, self.io.A)
                self._set_io(self._c_mem, self.io.C)
        except BaseException:
            self._destroy()
            raise

    @property
    def closed(self) -> bool:
        return not self._handle.value

    def _call(self, what: str, ret: int) -> None:
        if ret != 0:
            raise MatmulError(f"{what} for {self.shape} (core {self.core}, domain "
                              f"{self.domain}, {self.runtime_name}): {abi.error_name(ret)}")

    @property
    def handle(self) -> int:
        """The library's context handle (0 once closed): for diagnostics and tests."""
        return int(self._handle.value)

    @property
    def m(self) -> int | None:
        """The M the next run computes unless A needs another (None after a failed shape
        change: the next run sets it again)."""
        return self._m

    def _check_attrs(self) -> None:
        """The runtime's own view of A, B and C, at every declared M, must be the one this
        binding packs for; at every M the same B (one B buffer serves them all)."""
        s0 = self.shape
        sub_n, sub_k = native_tile(s0)
        problems = []
        for dyn, io in zip(self._dyn, self._ios, strict=True):
            s = replace(s0, m=dyn.M)
            b_dims = io.B.shape
            if io.A.shape != (s.m, s.k) or io.A.size < s.a_bytes:
                problems.append(f"A {io.A.shape} of {io.A.size} bytes")
            if io.C.shape != (s.m, s.n) or io.C.size < s.c_bytes:
                problems.append(f"C {io.C.shape} of {io.C.size} bytes")
            if len(b_dims) != 4 or b_dims[2:] != (sub_n, sub_k) or io.B.size < s.b_bytes:
                problems.append(f"native B {b_dims} of {io.B.size} bytes (expected tiles "
                                f"{sub_n} x {sub_k})")
            elif (b_dims, io.B.size) != (self.io.B.shape, self.io.B.size):
                problems.append(f"at M {s.m} a B {b_dims} of {io.B.size} bytes, at M "
                                f"{s0.m} {self.io.B.shape} of {self.io.B.size}")
        if problems:
            raise MatmulError(f"{s0}: the runtime describes {', '.join(problems)}; this "
                              "binding does not know that layout (docs/npu-matmul.md)")

    def _select(self, rows: int) -> None:
        """Make the smallest declared M >= ``rows`` the one in effect: the library's shape,
        then A and C set again (the SDK demo's order: set_io_mem after
        set_dynamic_shape); B stays set across shapes (lock held)."""
        if not self.rows:
            return
        i = next(j for j, m in enumerate(self.rows) if m >= rows)
        if self.rows[i] == self._m:
            return
        self._m = None
        assert self._a_mem is not None and self._c_mem is not None
        self._call("rknn_matmul_set_dynamic_shape",
                   self._lib.rknn_matmul_set_dynamic_shape(self._handle,
                                                           ctypes.byref(self._dyn[i])))
        self._set_io(self._a_mem, self._ios[i].A)
        self._set_io(self._c_mem, self._ios[i].C)
        self._io_now = self._ios[i]
        self._m = self.rows[i]

    def _create_mem(self, size: int) -> ctypes._Pointer:
        mem = self._lib.rknn_create_mem(self._handle, size)
        if not mem:
            raise MatmulError(f"rknn_create_mem({size}) for {self.shape} on domain "
                              f"{self.domain} failed (out of NPU memory or IOMMU space?)")
        return mem

    def _set_io(self, mem: ctypes._Pointer, attr: abi.MatmulTensorAttr) -> None:
        self._call("rknn_matmul_set_io_mem",
                   self._lib.rknn_matmul_set_io_mem(self._handle, mem, ctypes.byref(attr)))

    def _check_open(self) -> None:
        if self.closed:
            raise MatmulError(f"matmul context {self.shape} (core {self.core}) is closed")

    def _check_b(self, b: MatmulB) -> tuple[NativeB, ctypes._Pointer]:
        """``b`` and its memory, if ``b`` is a live B of this open context (typed as the
        protocol's ``MatmulB``: any other object is refused here, not by the caller)."""
        self._check_open()
        if not isinstance(b, NativeB) or b.context is not self:
            raise MatmulError(f"{self.shape}: this B belongs to another matmul context")
        if b._mem is None:
            raise MatmulError(f"{self.shape}: this B was freed")
        return b, b._mem

    def _operand(self, what: str, x: np.ndarray) -> np.ndarray:
        """fp16 takes any float array (rounded to fp16 on the copy in); int8 takes int8
        only (a wider integer would wrap silently)."""
        x = np.asarray(x)
        fp16 = self.shape.dtype == "fp16"
        if (x.dtype.kind != "f") if fp16 else (x.dtype != np.int8):
            raise MatmulError(f"{self.shape}: {what} must be "
                              f"{'floats' if fp16 else 'int8'}, got {x.dtype}")
        return x

    def new_b(self) -> NativeB:
        """A fresh B buffer (the runtime's new memory: zeros on the board and here)."""
        with self._lock:
            self._check_open()
            b = NativeB(self, self._create_mem(self.io.B.size))
            self._bs.append(b)
            return b

    def write_b(self, b: MatmulB, values: np.ndarray, row: int = 0, col: int = 0) -> None:
        """Write ``values`` [k', n'] into B[row:, col:] in the native layout in place
        (``row``, ``col`` multiples of the K and N alignments; the rest of B untouched)."""
        values = self._operand("B values", values)
        with self._lock:
            native, _ = self._check_b(b)
            write_native(native.values, self.shape, values, row, col)

    def run(self, a: np.ndarray, b: MatmulB, out: np.ndarray | None = None) -> np.ndarray:
        """C [rows, n] = A [rows, k] x B for 1 <= rows <= m (float32 for fp16, int32 for
        int8): a fresh array, or ``out`` (C-contiguous, that shape and dtype) filled. A
        dynamic context computes the smallest declared M >= rows; a static one all m."""
        a = self._operand("A", a)
        s = self.shape
        if a.ndim != 2 or a.shape[1] != s.k or not 1 <= a.shape[0] <= s.m:
            raise MatmulError(f"{s}: A must be [1..{s.m}, {s.k}], got {a.shape}")
        rows = a.shape[0]
        if out is not None and (out.shape != (rows, s.n) or out.dtype != s.c_dtype
                                or not out.flags.c_contiguous):
            raise MatmulError(f"{s}: out must be a C-contiguous {s.c_dtype} [{rows}, {s.n}], "
                              f"got {out.dtype} {out.shape}")
        with self._lock:
            native, mem = self._check_b(b)
            self._select(rows)
            np.copyto(self._a[:rows], a, casting="same_kind")
            if self._current_b is not native:
                self._set_io(mem, self._io_now.B)
                self._current_b = native
            self._call("rknn_matmul_run", self._lib.rknn_matmul_run(self._handle))
            if out is None:
                return self._c[:rows].copy()
            np.copyto(out, self._c[:rows])
            return out

    def rerun(self) -> None:
        """The library call alone, on the A and B of the last ``run`` (for benchmarks: the
        NPU's time without the copies in and out)."""
        with self._lock:
            self._check_open()
            if self._current_b is None or self._current_b.freed:
                raise MatmulError(f"{self.shape}: rerun needs a run first")
            self._call("rknn_matmul_run", self._lib.rknn_matmul_run(self._handle))

    def _free_b(self, b: NativeB) -> None:
        with self._lock:
            if b.freed or self.closed:
                return
            mem, b._mem = b._mem, None
            b.values = b.values[:0]
            self._bs.remove(b)
            if self._current_b is b:
                self._current_b = None
            self._call("rknn_destroy_mem", self._lib.rknn_destroy_mem(self._handle, mem))

    def _destroy(self) -> None:
        """Memory first (it needs the context), then the context; safe to repeat."""
        if not self._handle.value:
            return
        for b in self._bs:
            if b._mem is not None:
                self._lib.rknn_destroy_mem(self._handle, b._mem)
                b._mem = None
                b.values = b.values[:0]
        self._bs.clear()
        self._current_b = None
        for mem in (self._a_mem, self._c_mem):
            if mem is not None:
                self._lib.rknn_destroy_mem(self._handle, mem)
        self._a_mem = self._c_mem = None
        self._a = self._c = None  # type: ignore[assignment]
        self._m = None
        ret = self._lib.rknn_matmul_destroy(self._handle)
        self._handle = abi.Context(0)
        if ret != 0:
            log.warning("rknn_matmul_destroy for %s: %s", self.shape, abi.error_name(ret))

    def close(self) -> None:
        """Free every B and the context (safe twice; a B kept after this is dead)."""
        with self._lock:
            self._destroy()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"core {self.core}, domain {self.domain}"
        rows = f", M in {self.rows}" if self.rows else ""
        return f"RknnMatmulContext({self.shape}{rows}, {state}, {self.runtime_name})"

"""The compiled decode kernels (``mla_decode.c``, ``kda_decode.c``), loaded with ctypes.

``make`` builds ``_native.so`` next to this file for the machine it runs on
(``-march=native``, as llama.cpp builds by default). Without it, or with
``LING3_RKNN_NATIVE=0`` in the environment, ``mla.py`` and ``kda.py`` stay on their numpy
paths, which are also the reference the tests hold the kernels to. ctypes rather than a
CPython extension: the kernels need no Python API, so no Python headers on the board, and
ctypes releases the GIL during a call, which the glue's split threads rely on.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).with_name("_native.so")
ABI = 1  # LING3_NATIVE_ABI in native_vec.h: a library built from other sources is refused
_MLA_SCRATCH_ROWS = 64 + 2  # mla_decode.c's scratch: a group's scores, maxes, factors

_library: Any = None  # the ctypes library, once loaded
_loaded = False
_enabled = True


def _load() -> Any:
    global _library, _loaded
    if _loaded:
        return _library
    _loaded = True
    if os.environ.get("LING3_RKNN_NATIVE", "1") == "0" or not LIBRARY.exists():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        mla, kda = lib.mla_decode_attend, lib.kda_decode_heads
        abi = lib.ling3_native_abi()
    except (OSError, AttributeError) as exc:  # built for another machine, or stale
        log.warning("compiled kernels %s not usable (%s); using numpy", LIBRARY.name, exc)
        return None
    if abi != ABI:
        log.warning("compiled kernels %s are from other sources (ABI %d, want %d; run make); "
                    "using numpy", LIBRARY.name, abi, ABI)
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    mla.argtypes = [ptr, i32, i32, i32, ptr, ptr, i32, i64, ptr, ptr, ptr, ptr]
    mla.restype = i32
    kda.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, f32,
                    f32, ptr, i32, i32, ptr]
    kda.restype = i32
    _library = lib
    return lib


def available() -> bool:
    """Whether the decode glue runs compiled (built, loadable and not switched off)."""
    return _enabled and _load() is not None


def set_enabled(enabled: bool) -> None:
    """Switch the kernels off or back on for this process (A/B benchmarks, tests)."""
    global _enabled
    _enabled = enabled


def _plain(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


def mla_attend(q_t: np.ndarray, blocks: Sequence[np.ndarray], key0: int, visible: int, r: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``mla._attend`` for one token: q_t [d, heads] (scaled query, head-minor) over the rows
    of ``blocks`` from key position ``key0`` up to ``visible``. Returns (ctx^T [r, heads],
    denominator, running max), or None when the kernel is off or the blocks are not plain
    float32 rows of one width (the caller then takes the numpy path)."""
    lib = _load() if _enabled else None
    if lib is None:
        return None
    d, heads = q_t.shape
    ptrs: list[int] = []
    lengths: list[int] = []
    stride = blocks[0].shape[1] if blocks else 0
    pos = key0
    for block in blocks:
        if pos >= visible:
            break
        if (block.dtype != np.float32 or block.ndim != 2 or block.shape[1] != stride
                or block.strides != (4 * stride, 4)):
            return None
        n = min(block.shape[0], visible - pos)
        ptrs.append(block.ctypes.data)
        lengths.append(n)
        pos += n
    if not ptrs or d > stride or r > d:
        return None
    q_t = np.ascontiguousarray(q_t, dtype=np.float32)
    ctx = np.empty((r, heads), dtype=np.float32)
    denom = np.empty(heads, dtype=np.float32)
    run_max = np.empty(heads, dtype=np.float32)
    scratch = np.empty(_MLA_SCRATCH_ROWS * heads, dtype=np.float32)
    block_ptrs = np.array(ptrs, dtype=np.uintp)
    block_lengths = np.array(lengths, dtype=np.int64)
    lib.mla_decode_attend(
        q_t.ctypes.data, heads, d, r, block_ptrs.ctypes.data, block_lengths.ctypes.data,
        len(ptrs), stride, ctx.ctypes.data, denom.ctypes.data, run_max.ctypes.data,
        scratch.ctypes.data)
    return ctx, denom, run_max


class KdaDecodeCall:
    """One layer's decode token for ``kda_decode.c``: the arrays checked once, then
    ``run(h0, h1)`` per share of the heads (each share may run on its own thread; they
    touch disjoint channels, state rows and queue entries)."""

    def __init__(self, lib: Any, qkv: np.ndarray, tail: np.ndarray, taps: np.ndarray,
                 log_decay: np.ndarray, beta: np.ndarray, body: np.ndarray, scale: np.ndarray,
                 keys: np.ndarray, deltas: np.ndarray, pending: int, fold_below: float,
                 fold_rows_below: float) -> None:
        self._lib = lib
        self.heads, self.d = scale.shape
        self.queue = keys.shape[1]
        self.out = np.empty((self.heads, self.d), dtype=np.float32)
        self._args = (qkv, tail, taps, log_decay, beta, body, scale, keys, deltas)
        self._k = taps.shape[0]
        self._pending = pending
        self._fold = (fold_below, fold_rows_below)

    def run(self, h0: int, h1: int) -> bool:
        """Heads [h0, h1); True when rows of their state were folded."""
        qkv, tail, taps, log_decay, beta, body, scale, keys, deltas = self._args
        scratch = np.empty(3 * (h1 - h0) * self.d + 4 * self.d + 2 * self.queue, np.float32)
        return bool(self._lib.kda_decode_heads(
            qkv.ctypes.data, tail.ctypes.data, taps.ctypes.data, self._k, self.heads, self.d,
            log_decay.ctypes.data, beta.ctypes.data, body.ctypes.data, scale.ctypes.data,
            keys.ctypes.data, deltas.ctypes.data, self.queue, self._pending, self._fold[0],
            self._fold[1], self.out.ctypes.data, h0, h1, scratch.ctypes.data))


def kda_decode_call(qkv: np.ndarray, tail: np.ndarray, taps: np.ndarray,
                    log_decay: np.ndarray, beta: np.ndarray, body: np.ndarray,
                    scale: np.ndarray, keys: np.ndarray, deltas: np.ndarray, pending: int,
                    fold_below: float, fold_rows_below: float) -> KdaDecodeCall | None:
    """A ready ``KdaDecodeCall``, or None when the kernel is off or an array is not plain
    C-ordered float32 of the expected shape (the caller then takes the numpy path)."""
    lib = _load() if _enabled else None
    if lib is None:
        return None
    heads, d = scale.shape
    p = heads * d
    k = taps.shape[0]
    shapes_fit = (qkv.shape == (3 * p,) and tail.shape == (k - 1, 3 * p)
                  and taps.shape == (k, 3 * p) and log_decay.shape == (heads, d)
                  and beta.shape == (heads,) and body.shape == (heads, d, d)
                  and keys.shape == deltas.shape and keys.shape[::2] == (heads, d)
                  and 0 <= pending < keys.shape[1])
    if not shapes_fit or not _plain(qkv, tail, taps, log_decay, beta, body, scale, keys,
                                    deltas):
        return None
    return KdaDecodeCall(lib, qkv, tail, taps, log_decay, beta, body, scale, keys, deltas,
                         pending, fold_below, fold_rows_below)

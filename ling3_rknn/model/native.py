"""The compiled glue kernels (``mla_attention.c``, ``kda_decode.c``), built and loaded here.

The C sources ship with the package; the first model load on a machine compiles them with
its C compiler for that machine (``-march=native``, as llama.cpp builds by default: the
host's AVX-512 or AVX2, the RK3588's NEON with fp16 and dot products) into the state
directory (``ling3_rknn.paths``; ``/var/lib/ling3-rknn`` under the systemd unit), named by a
hash of the sources, the flags and the CPU, so a later start loads it in milliseconds and
an upgrade or another CPU builds its own. Without a compiler, or with
``LING3_RKNN_NATIVE=0``, ``mla.py`` and ``kda.py`` stay on their numpy paths, which are also
the reference the tests hold the kernels to; ``ling3-rknn doctor`` says which is in use.

ctypes rather than a CPython extension: the kernels need no Python API, so no Python
headers on the board, and ctypes releases the GIL during a call, which the glue's split
threads rely on.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..paths import state_directory

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = ("mla_attention.c", "kda_decode.c")
HEADERS = ("native_vec.h",)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 300
ABI = 3  # LING3_NATIVE_ABI in native_vec.h: a library built from other sources is refused
_MLA_GROUP = 64  # mla_attention.c's GROUP: rows scored together
_MLA_SCRATCH_ROWS = _MLA_GROUP + 2  # its scratch per head: a group's scores, maxes, factors
_LANES = 16  # mla_attention.c's HEADS: query columns per prefill tile (the vector lanes)
_TILE_BLOCK = 4  # mla_attention.c's TILE_BLOCK: prefill tiles sharing a group of rows

_library: Any = None  # the ctypes library, once loaded
_loaded = False
_enabled = True
_status = "not loaded yet"


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, if it is on PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    keep = ("model name", "flags", "Features", "CPU part", "CPU implementer")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))


def library_path(cc: str) -> Path:
    """Where the library for these sources, this compiler and this CPU lives."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((SOURCE_DIR / name).read_bytes())
    for part in (cc, *CFLAGS, platform.machine(), _cpu_identity()):
        digest.update(part.encode() + b"\0")
    return state_directory() / "native" / f"ling3-native-{digest.hexdigest()[:16]}.so"


def build(cc: str, target: Path) -> None:
    """Compile the kernels into ``target``, written whole or not at all (concurrent builds
    each write their own temporary file). Raises OSError / CalledProcessError /
    TimeoutExpired with the compiler's message."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, *(str(SOURCE_DIR / s) for s in SOURCES), "-lm"],
                       check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _find_or_build() -> Path | None:
    global _status
    cc = compiler()
    if cc is None:
        _status = "no C compiler (cc or $CC) on PATH: decode glue on numpy"
        return None
    target = library_path(cc)
    if target.exists():
        return target
    started = time.monotonic()
    try:
        build(cc, target)
    except subprocess.CalledProcessError as exc:
        _status = f"{cc} failed: {exc.stderr.strip()[-500:]}"
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        _status = f"could not build into {target.parent}: {exc}"
        return None
    log.info("built the decode kernels for this machine in %.1f s: %s",
             time.monotonic() - started, target)
    return target


def _load() -> Any:
    global _library, _loaded, _status
    if _loaded:
        return _library
    _loaded = True
    if os.environ.get("LING3_RKNN_NATIVE", "1") == "0":
        _status = "switched off (LING3_RKNN_NATIVE=0): decode glue on numpy"
        return None
    path = _find_or_build()
    if path is None:
        log.warning("compiled decode kernels unavailable (%s); using numpy", _status)
        return None
    try:
        lib = ctypes.CDLL(str(path))
        abi = lib.ling3_native_abi()
        if abi != ABI:  # before any other symbol: older sources may lack newer kernels
            _status = f"{path} is from other sources (ABI {abi}, want {ABI})"
            log.warning("compiled decode kernels: %s; using numpy", _status)
            return None
        mla, kda = lib.mla_decode_attend, lib.kda_decode_heads
        prefill = lib.mla_prefill_attend
    except (OSError, AttributeError) as exc:
        _status = f"{path} not usable ({exc})"
        log.warning("compiled decode kernels %s; using numpy", _status)
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    mla.argtypes = [ptr, i32, i32, i32, ptr, ptr, i32, i64, i32, ptr, ptr, ptr, ptr]
    mla.restype = i32
    prefill.argtypes = [ptr, ptr, i32, i32, i32, i32, ptr, ptr, i32, i64, i32, i64, ptr,
                        ptr]
    prefill.restype = i32
    kda.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, f32,
                    f32, ptr, i32, i32, ptr]
    kda.restype = i32
    _library = lib
    _status = f"compiled ({path})"
    return lib


def status() -> str:
    """One line: the library in use, or why the decode glue runs on numpy."""
    _load()
    return _status


def available() -> bool:
    """Whether the decode glue runs compiled (built, loadable and not switched off)."""
    return _enabled and _load() is not None


def set_enabled(enabled: bool) -> None:
    """Switch the kernels off or back on for this process (A/B benchmarks, tests)."""
    global _enabled
    _enabled = enabled


def _plain(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


class _CacheRows:
    """The cache rows a kernel reads: block pointers and row counts up to a key position,
    checked once (float32 or float16, C-ordered rows of one width)."""

    def __init__(self, ptrs: np.ndarray, lengths: np.ndarray, stride: int, half: bool) -> None:
        self.ptrs, self.lengths, self.stride, self.half = ptrs, lengths, stride, half

    @classmethod
    def of(cls, blocks: Sequence[np.ndarray], key0: int, visible: int) -> _CacheRows | None:
        if not blocks:
            return None
        ptrs: list[int] = []
        lengths: list[int] = []
        dtype = blocks[0].dtype
        stride = blocks[0].shape[1] if blocks[0].ndim == 2 else 0
        pos = key0
        for block in blocks:
            if pos >= visible:
                break
            if (block.dtype != dtype or block.ndim != 2 or block.shape[1] != stride
                    or block.strides != (dtype.itemsize * stride, dtype.itemsize)):
                return None
            n = min(block.shape[0], visible - pos)
            ptrs.append(block.ctypes.data)
            lengths.append(n)
            pos += n
        if not ptrs or dtype not in (np.float32, np.float16):
            return None
        return cls(np.array(ptrs, dtype=np.uintp), np.array(lengths, dtype=np.int64), stride,
                   dtype == np.float16)


def mla_attend(q_t: np.ndarray, blocks: Sequence[np.ndarray], key0: int, visible: int, r: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``mla._attend`` for one token: q_t [d, heads] (scaled query, head-minor) over the rows
    of ``blocks`` (float32 or float16 cache rows) from key position ``key0`` up to
    ``visible``. Returns (ctx^T [r, heads], denominator, running max), or None when the
    kernel is off or cannot read the blocks (the caller then takes the numpy path)."""
    lib = _load() if _enabled else None
    if lib is None:
        return None
    rows = _CacheRows.of(blocks, key0, visible)
    d, heads = q_t.shape
    if rows is None or d > rows.stride or r > d:
        return None
    q_t = np.ascontiguousarray(q_t, dtype=np.float32)
    ctx = np.empty((r, heads), dtype=np.float32)
    denom = np.empty(heads, dtype=np.float32)
    run_max = np.empty(heads, dtype=np.float32)
    scratch = np.empty(_MLA_SCRATCH_ROWS * heads + (_MLA_GROUP * rows.stride if rows.half else 0),
                       dtype=np.float32)
    status = lib.mla_decode_attend(
        q_t.ctypes.data, heads, d, r, rows.ptrs.ctypes.data, rows.lengths.ctypes.data,
        len(rows.ptrs), rows.stride, int(rows.half), ctx.ctypes.data, denom.ctypes.data,
        run_max.ctypes.data, scratch.ctypes.data)
    return (ctx, denom, run_max) if status == 0 else None


class PrefillAttention:
    """A prefill chunk's causal attention for ``mla_attention.c``'s ``mla_prefill_attend``:
    the query columns packed into 16-lane tiles and the cache rows checked once, then
    ``run(first, stop)`` per share of the tiles (each share may run on its own thread: tiles
    are independent and write disjoint rows of the result)."""

    def __init__(self, lib: Any, q: np.ndarray, q_pos: np.ndarray, rows: _CacheRows,
                 mask_from: int, r: int, score_offset: int) -> None:
        n, d = q.shape
        self.tiles = -(-n // _LANES)
        padded = np.zeros((self.tiles * _LANES, d), dtype=np.float32)
        padded[:n] = q
        # [tiles, d, 16]: each tile's columns as the lanes of one vector per channel
        self._q_t = np.ascontiguousarray(padded.reshape(self.tiles, _LANES, d).transpose(0, 2, 1))
        pos = np.full(self.tiles * _LANES, int(q_pos.max()), dtype=np.int32)  # padding lanes
        pos[:n] = q_pos
        self._pos = pos
        self._lib, self._rows, self._mask_from, self._r, self._n = lib, rows, mask_from, r, n
        self._offset = score_offset
        self._ctx_t = np.empty((self.tiles, r, _LANES), dtype=np.float32)
        self.failed = False

    def run(self, first: int, stop: int) -> None:
        """Tiles [first, stop)."""
        if stop <= first:
            return
        rows = self._rows
        scratch = np.empty(_TILE_BLOCK * (_MLA_GROUP + 2) * _LANES + 2 * _LANES
                           + (_MLA_GROUP * rows.stride if rows.half else 0), dtype=np.float32)
        d = self._q_t.shape[1]
        status = self._lib.mla_prefill_attend(
            self._q_t[first].ctypes.data, self._pos[first * _LANES:].ctypes.data, stop - first,
            d, self._r, self._offset, rows.ptrs.ctypes.data, rows.lengths.ctypes.data,
            len(rows.ptrs), rows.stride, int(rows.half), self._mask_from,
            self._ctx_t[first].ctypes.data, scratch.ctypes.data)
        if status != 0:
            self.failed = True

    def result(self) -> np.ndarray:
        """The normalised context of every column, [columns, r]."""
        return self._ctx_t.transpose(0, 2, 1).reshape(-1, self._r)[: self._n]


def mla_prefill(q: np.ndarray, q_pos: np.ndarray, blocks: Sequence[np.ndarray], visible: int,
                mask_from: int, r: int, score_offset: int = 0) -> PrefillAttention | None:
    """A ready ``PrefillAttention`` for query columns ``q`` [n, d] (scaled) at positions
    ``q_pos`` over the first ``visible`` rows of ``blocks``, rows below ``mask_from`` seen by
    every column. Scores use a row's channels from ``score_offset`` on, the context its
    first ``r``. None when the kernel is off or cannot read the blocks."""
    lib = _load() if _enabled else None
    if lib is None:
        return None
    rows = _CacheRows.of(blocks, 0, visible)
    n, d = q.shape
    if rows is None or score_offset + d > rows.stride or r > rows.stride or n == 0:
        return None
    return PrefillAttention(lib, np.asarray(q, dtype=np.float32), q_pos, rows, mask_from, r,
                            score_offset)


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

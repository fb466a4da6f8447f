"""The compiled glue kernels (``mla_attention.c``, ``kda_decode.c``, ``kda_chunk.c``), loaded
here.

They are built when the package is installed (``ling3-rknn build-kernels``, run by ``make
venv`` and the board guide's install step: ``native_build.py``), for that machine's CPU,
into the install's kernel directory. Loading only opens that library: it checks the
manifest beside it (the same sources, the same CPU), the ABI version compiled into it,
and binds the functions ``native_abi.h`` declares; it never runs a compiler. The first
model load logs which glue runs (the library, its path and instruction set, or numpy and
why), and ``ling3-rknn doctor`` says the same. Without a usable library, or with
``LING3_RKNN_NATIVE=0``, ``mla.py`` and ``kda.py`` stay on their numpy paths, which are
also the reference the tests hold the kernels to.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .native_abi import abi
from .native_build import LIBRARY, MANIFEST, Manifest, kernel_directory

log = logging.getLogger(__name__)

NATIVE_ENV = "LING3_RKNN_NATIVE"  # "0": the numpy glue, whatever is installed
ABI = abi().version
_MLA_GROUP = abi().constants["LING3_MLA_GROUP"]  # rows scored together
_MLA_SCRATCH_ROWS = _MLA_GROUP + 2  # the decode kernel's scratch per head (native_abi.h)
_LANES = abi().constants["LING3_LANES"]  # query columns per prefill tile (the vector lanes)
_TILE_BLOCK = abi().constants["LING3_MLA_TILE_BLOCK"]  # prefill tiles sharing a row group
_KDA_SUB = abi().constants["LING3_KDA_SUB"]
_KDA_MAX_CHUNK = abi().constants["LING3_KDA_MAX_CHUNK"]
_KDA_D_MULTIPLE = abi().constants["LING3_KDA_D_MULTIPLE"]

_library: Any = None  # the ctypes library, once loaded
_loaded = False
_enabled = True
_status = "not loaded yet"
_FIX = "to build them: `ling3-rknn build-kernels` in this venv, with a C compiler"


def library_path() -> Path:
    """Where the installed library is looked for."""
    return kernel_directory() / LIBRARY


def _open(path: Path) -> tuple[Any, str] | str:
    """The bound library and its status line, or why it cannot be used."""
    manifest_path = path.with_name(MANIFEST)
    if not path.exists() or not manifest_path.exists():
        return f"not built: no {LIBRARY} in {path.parent}"
    try:
        manifest = Manifest.read(manifest_path)
    except (OSError, ValueError, TypeError) as exc:
        return f"{manifest_path} not readable ({exc})"
    problem = manifest.mismatch()
    if problem is not None:
        return f"{path} {problem}"
    try:
        lib = ctypes.CDLL(str(path))
        found = lib.ling3_native_abi()
        if found != ABI:  # before any other symbol: older sources may lack newer kernels
            return f"{path} is from other sources (ABI {found}, want {ABI})"
        abi().bind(lib)
    except (OSError, AttributeError) as exc:
        return f"{path} not usable ({exc})"
    return lib, f"compiled ({path}; {manifest.isa}; built {manifest.built} by {manifest.compiler})"


def _load(path: Path | None = None) -> Any:
    global _library, _loaded, _status
    if _loaded:
        return _library
    _loaded = True
    if os.environ.get(NATIVE_ENV, "1") == "0":
        _status = f"switched off ({NATIVE_ENV}=0): decode glue on numpy"
        log.info("decode glue: numpy (%s)", _status)
        return None
    opened = _open(path or library_path())
    if isinstance(opened, str):
        _status = f"{opened}: decode glue on numpy"
        log.warning("compiled decode kernels unavailable: %s (%s)", _status, _FIX)
        return None
    _library, _status = opened
    log.info("decode glue: %s", _status)
    return _library


def status() -> str:
    """One line: the library in use, or why the decode glue runs on numpy."""
    _load()
    return _status


def available() -> bool:
    """Whether the decode glue runs compiled (built, loadable and not switched off)."""
    return _enabled and _load() is not None


def use_library(directory: Path | None = None) -> str:
    """Open the kernels built in ``directory`` (None: the installed ones) in place of the
    library this process uses now, with the same checks as the first load, and return the
    status line. For running the same calls on several builds in one process: the tests
    hold every vector width a machine can build to the numpy paths (tests/conftest.py).
    The library given up stays mapped (ctypes cannot unload it): arrays it handed out are
    numpy's own, so nothing refers into it."""
    global _library, _loaded
    _library, _loaded = None, False
    _load(directory / LIBRARY if directory is not None else None)
    return _status


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


class KdaChunkCall:
    """A KDA layer's prefill piece for ``kda_chunk.c``: the arrays checked once, then
    ``run(h0, h1)`` per share of the heads (each share may run on its own thread; heads
    touch disjoint state and output channels)."""

    def __init__(self, lib: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                 log_decay: np.ndarray, beta: np.ndarray, state: np.ndarray, chunk: int
                 ) -> None:
        self._lib = lib
        self._args = (q, k, v, log_decay, beta, state)
        self.t_len, self.heads, self.d = k.shape
        self._chunk = chunk
        self.out = np.empty_like(v)
        self.failed = False

    def run(self, h0: int, h1: int) -> None:
        """Heads [h0, h1)."""
        q, k, v, log_decay, beta, state = self._args
        d, c = self.d, self._chunk
        scratch = np.empty(c * (5 * d + 2 * c + 1) + (_KDA_SUB + 2) * d, dtype=np.float32)
        status = self._lib.kda_chunk_heads(
            q.ctypes.data, k.ctypes.data, v.ctypes.data, log_decay.ctypes.data,
            beta.ctypes.data, self.t_len, self.heads, d, c, state.ctypes.data,
            self.out.ctypes.data, h0, h1, scratch.ctypes.data)
        if status != 0:
            self.failed = True


def kda_chunk_call(q: np.ndarray, k: np.ndarray, v: np.ndarray, log_decay: np.ndarray,
                   beta: np.ndarray, state: np.ndarray, chunk: int) -> KdaChunkCall | None:
    """A ready ``KdaChunkCall`` for q, k, v, log_decay [T, heads, d], beta [T, heads] and the
    state body [heads, d, d], or None when the kernel is off or cannot take them (not plain
    C-ordered float32, another shape, a head width or chunk it does not take): the caller
    then takes the numpy path."""
    if k.ndim != 3 or not kda_chunk_takes(k.shape[2], chunk):
        return None
    t_len, heads, d = k.shape
    shapes_fit = (q.shape == k.shape == v.shape == log_decay.shape and t_len > 0
                  and beta.shape == (t_len, heads) and state.shape == (heads, d, d))
    if not shapes_fit or not _plain(q, k, v, log_decay, beta, state):
        return None
    return KdaChunkCall(_load(), q, k, v, log_decay, beta, state, chunk)


def kda_chunk_takes(d: int, chunk: int) -> bool:
    """Whether ``kda_chunk.c`` runs pieces of heads ``d`` wide in chunks of ``chunk``: the
    kernel is on and loaded and the widths are ones it takes."""
    return (_enabled and d > 0 and d % _KDA_D_MULTIPLE == 0 and 1 <= chunk <= _KDA_MAX_CHUNK
            and _load() is not None)


def softmax_piece(scores: np.ndarray, limit: np.ndarray, run_max: np.ndarray,
                  denom: np.ndarray, acc: np.ndarray, p: np.ndarray) -> bool:
    """``attn_softmax.c``'s online softmax over one piece of an NPU attention's scores
    [m, n] (row i sees its first ``limit[i]`` columns): rescales ``run_max``, ``denom`` [m]
    and ``acc`` [m, dv] in place and writes the float16 probabilities into ``p`` [m, n].
    False when the kernel is off or cannot run here (the caller then takes numpy's path);
    raises ValueError for a limit outside [0, n]."""
    lib = _load() if _enabled else None
    if lib is None:
        return False
    m, n = scores.shape
    if (not _plain(scores, run_max, denom, acc) or limit.dtype != np.int32
            or not limit.flags.c_contiguous or p.dtype != np.float16
            or not p.flags.c_contiguous or p.shape != (m, n) or limit.shape != (m,)
            or run_max.shape != (m,) or denom.shape != (m,) or acc.ndim != 2
            or acc.shape[0] != m):
        return False
    status = lib.attn_softmax_piece(
        scores.ctypes.data, m, n, limit.ctypes.data, run_max.ctypes.data, denom.ctypes.data,
        acc.ctypes.data, acc.shape[1], p.ctypes.data)
    if status == -1:
        raise ValueError(f"softmax limits must lie in [0, {n}]")
    return status == 0


def half_rows(src: np.ndarray, dst: np.ndarray, scale: float = 1.0) -> bool:
    """``attn_softmax.c``'s float32 -> float16 conversion: ``dst[...] = src * scale`` for
    2-D views whose rows are contiguous (any row stride). False when the kernel is off,
    cannot run here or the arrays do not fit (the caller then converts in numpy)."""
    lib = _load() if _enabled else None
    if (lib is None or src.ndim != 2 or src.shape != dst.shape or src.dtype != np.float32
            or dst.dtype != np.float16 or src.strides[1] != 4 or dst.strides[1] != 2
            or src.strides[0] % 4 or dst.strides[0] % 2 or not dst.flags.writeable):
        return False
    if not src.size:
        return True
    status = lib.half_rows(src.ctypes.data, src.shape[0], src.shape[1], src.strides[0] // 4,
                           scale, dst.ctypes.data, dst.strides[0] // 2)
    return status == 0


def moe_quantize_rows(src: np.ndarray, rows: np.ndarray, dst: np.ndarray,
                      scales: np.ndarray) -> bool:
    """``moe_int8.c``: rows ``rows`` of ``src`` [*, d] quantised per row into ``dst`` [m, d]
    int8 and ``scales`` [m]. False when the kernel is off or the arrays do not fit."""
    lib = _load() if _enabled else None
    m = len(rows)
    if (lib is None or not _plain(src, scales) or src.ndim != 2 or rows.dtype != np.int64
            or not rows.flags.c_contiguous or dst.dtype != np.int8
            or not dst.flags.c_contiguous or dst.shape != (m, src.shape[1])
            or scales.shape != (m,)):
        return False
    if m and (rows.min() < 0 or rows.max() >= len(src)):
        raise IndexError("a row index lies outside the source")
    lib.moe_quantize_rows(src.ctypes.data, src.shape[1], rows.ctypes.data, m,
                          dst.ctypes.data, scales.ctypes.data)
    return True


def moe_swiglu_quantize(c: np.ndarray, row_scale: np.ndarray, col_scale: np.ndarray,
                        dst: np.ndarray, dst_scale: np.ndarray) -> bool:
    """``moe_int8.c``: gate|up int32 products [m, 2i] to the int8 SwiGLU intermediate."""
    lib = _load() if _enabled else None
    if lib is None or c.ndim != 2 or c.shape[1] % 2:
        return False
    m, inter = c.shape[0], c.shape[1] // 2
    if (c.dtype != np.int32 or not c.flags.c_contiguous or not _plain(row_scale, col_scale,
                                                                      dst_scale)
            or row_scale.shape != (m,) or col_scale.shape != (2 * inter,)
            or dst.dtype != np.int8 or not dst.flags.c_contiguous
            or dst.shape != (m, inter) or dst_scale.shape != (m,)):
        return False
    scratch = np.empty(inter, np.float32)
    lib.moe_swiglu_quantize(c.ctypes.data, m, inter, row_scale.ctypes.data,
                            col_scale.ctypes.data, dst.ctypes.data, dst_scale.ctypes.data,
                            scratch.ctypes.data)
    return True


def moe_scatter_add(c: np.ndarray, row_scale: np.ndarray, col_scale: np.ndarray,
                    weight: np.ndarray, rows: np.ndarray, out: np.ndarray) -> bool:
    """``moe_int8.c``: down int32 products [m, d], dequantised and weighted, into
    ``out[rows]`` (rows may repeat: added in order)."""
    lib = _load() if _enabled else None
    if lib is None or c.ndim != 2:
        return False
    m, d = c.shape
    if (c.dtype != np.int32 or not c.flags.c_contiguous
            or not _plain(row_scale, col_scale, weight, out) or row_scale.shape != (m,)
            or col_scale.shape != (d,) or weight.shape != (m,) or out.ndim != 2
            or out.shape[1] != d or rows.dtype != np.int64 or rows.shape != (m,)
            or not rows.flags.c_contiguous):
        return False
    if m and (rows.min() < 0 or rows.max() >= len(out)):
        raise IndexError("a row index lies outside the output")
    lib.moe_scatter_add(c.ctypes.data, m, d, row_scale.ctypes.data, col_scale.ctypes.data,
                        weight.ctypes.data, rows.ctypes.data, out.ctypes.data)
    return True

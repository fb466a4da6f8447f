"""B's native layout on RK3588, and writing blocks of B into it in place.

``rknn_matmul_api.h`` (SDK 2.3.2) lays B [K, N] out as tiles of ``sub_n`` columns by
``sub_k`` rows: ``[N / sub_n, K / sub_k, sub_n, sub_k]``, i.e. for each group of
``sub_n`` columns, K in steps of ``sub_k``, each tile column-major (the ``sub_k`` values of
one column contiguous). fp16: sub_n 16, sub_k 32; int8: sub_n 32, sub_k 32. Past
K = 8192 B is split into segments of 8192 rows, each laid out so on its own and stored one
after the other (docs/npu-matmul.md). This is our packing, not librknnrt's: the tests
compare it with the library's ``rknn_B_normal_layout_to_native_layout``.

Writes go straight into B's memory through strided numpy views (no staging copy), and
touch only the written rows and columns: the attention appends keys and values piece by
piece into a B that holds the earlier ones.
"""

from __future__ import annotations

import numpy as np

from ling3_rknn.npu.matmul_plan import ALIGN, MatmulError, MatmulShape

SEGMENT_K = 8192


def native_tile(shape: MatmulShape) -> tuple[int, int]:
    """(sub_n, sub_k) of B's native tiles: the plan's N and K alignments."""
    k_align, n_align = ALIGN[shape.dtype]
    return n_align, k_align


def segments(k: int) -> list[tuple[int, int]]:
    """(first row, rows) of each native segment of a B with ``k`` rows."""
    return [(k0, min(SEGMENT_K, k - k0)) for k0 in range(0, k, SEGMENT_K)]


def _segment_view(memory: np.ndarray, shape: MatmulShape, k0: int, rows: int) -> np.ndarray:
    sub_n, sub_k = native_tile(shape)
    flat = memory[k0 * shape.n: (k0 + rows) * shape.n]
    return flat.reshape(shape.n // sub_n, rows // sub_k, sub_n, sub_k)


def _splits(start: int, stop: int, tile: int) -> list[tuple[int, int]]:
    """[start, stop) (start a multiple of ``tile``) as whole tiles, then one partial tile."""
    whole = start + (stop - start) // tile * tile
    parts = [(start, whole)] if whole > start else []
    return parts + ([(whole, stop)] if stop > whole else [])


def write_native(memory: np.ndarray, shape: MatmulShape, values: np.ndarray, row: int,
                 col: int) -> None:
    """Write ``values`` [k', n'] into B[row:row + k', col:col + n'] held natively in
    ``memory`` (B's buffer as a flat array of its element type). ``row`` and ``col`` must
    be multiples of the K and N alignments; the block must fit. Casts as numpy assignment
    does (``same_kind``), without an intermediate copy."""
    sub_n, sub_k = native_tile(shape)
    if values.ndim != 2:
        raise MatmulError(f"{shape}: a block of B must be 2-D, got shape {values.shape}")
    rows, cols = values.shape
    if row < 0 or col < 0 or row % sub_k or col % sub_n:
        raise MatmulError(f"{shape}: a block of B must start at a row multiple of {sub_k} "
                          f"and a column multiple of {sub_n}, got ({row}, {col})")
    if row + rows > shape.k or col + cols > shape.n:
        raise MatmulError(f"{shape}: block [{rows}, {cols}] at ({row}, {col}) is outside "
                          f"B [{shape.k}, {shape.n}]")
    for k0, seg_rows in segments(shape.k):
        r0, r1 = max(row, k0), min(row + rows, k0 + seg_rows)
        if r0 >= r1:
            continue
        view = _segment_view(memory, shape, k0, seg_rows)
        for a0, a1 in _splits(r0 - k0, r1 - k0, sub_k):
            kt0, ki0 = divmod(a0, sub_k)
            kt1 = kt0 + max(1, (a1 - a0) // sub_k)
            ki1 = sub_k if a1 - a0 >= sub_k else a1 - a0
            for b0, b1 in _splits(col, col + cols, sub_n):
                nt0 = b0 // sub_n
                nt1 = nt0 + max(1, (b1 - b0) // sub_n)
                ni1 = sub_n if b1 - b0 >= sub_n else b1 - b0
                block = values[a0 + k0 - row: a1 + k0 - row, b0 - col: b1 - col]
                block = block.reshape(kt1 - kt0, ki1 - ki0, nt1 - nt0, ni1)
                np.copyto(view[nt0:nt1, kt0:kt1, :ni1, ki0:ki1],
                          block.transpose(2, 0, 3, 1), casting="same_kind")


def read_native(memory: np.ndarray, shape: MatmulShape) -> np.ndarray:
    """The whole of B [k, n] in the normal layout, from its native ``memory`` (a copy)."""
    out = np.empty((shape.k, shape.n), memory.dtype)
    for k0, seg_rows in segments(shape.k):
        view = _segment_view(memory, shape, k0, seg_rows)
        out[k0: k0 + seg_rows] = view.transpose(1, 3, 0, 2).reshape(seg_rows, shape.n)
    return out

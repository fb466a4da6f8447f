"""The routed experts' activations around int8 matmuls (the NPU's, in prefill): per-row
symmetric quantisation, the SwiGLU between the two projections, the weighted scatter back.

Compiled in ``moe_int8.c`` (one pass each; numpy's ~10 passes cost more than every other
CPU share of an NPU prefill: docs/performance.md, "Prefill budget"); the numpy forms here
are the fallback and the reference the kernels are tested against. A row's scale is
max|x| / 127 (0 for a zero row), its values round(x * 127 / max|x|) half away from zero
(in float32; the kernel may fuse the product into the rounding's addition, so a value
within one float32 step of a half may land one int8 step apart); a product c_ij of rows
quantised with scales a_i and weights with per-column scales w_j stands for c_ij a_i w_j.
"""

from __future__ import annotations

import numpy as np

from . import native


def quantize_rows(src: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of ``src`` [*, d] as int8 [m, d] and their scales [m]."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    src = np.ascontiguousarray(src, dtype=np.float32)
    q = np.empty((len(rows), src.shape[1]), np.int8)
    scales = np.empty(len(rows), np.float32)
    if native.moe_quantize_rows(src, rows, q, scales):
        return q, scales
    return _quantize(src[rows])


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    top = np.abs(x).max(axis=1)
    scales = (top / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    y = (x * inv[:, None]).astype(np.float32)
    half = np.where(y < 0, np.float32(-0.5), np.float32(0.5)).astype(np.float32)
    return np.trunc(y + half).astype(np.int8), scales


def swiglu_quantize(c: np.ndarray, row_scale: np.ndarray, col_scale: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """gate|up int32 products [m, 2i] -> SiLU(gate) * up, as int8 [m, i] and scales [m]."""
    m, two_i = c.shape
    inter = two_i // 2
    q = np.empty((m, inter), np.int8)
    scales = np.empty(m, np.float32)
    c = np.ascontiguousarray(c, dtype=np.int32)
    row_scale = np.ascontiguousarray(row_scale, dtype=np.float32)
    col_scale = np.ascontiguousarray(col_scale, dtype=np.float32)
    if native.moe_swiglu_quantize(c, row_scale, col_scale, q, scales):
        return q, scales
    x = c.astype(np.float32) * col_scale[None, :] * row_scale[:, None]
    gate, up = x[:, :inter], x[:, inter:]
    with np.errstate(over="ignore"):  # exp(-g) -> inf for a very negative g: SiLU -> 0
        h = gate / (1 + np.exp(-gate)) * up
    return _quantize(h)


def scatter_add(c: np.ndarray, row_scale: np.ndarray, col_scale: np.ndarray,
                weight: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """out[rows[i]] += weight[i] * dequantised down products c [m, d] (rows may repeat)."""
    c = np.ascontiguousarray(c, dtype=np.int32)
    args = (np.ascontiguousarray(row_scale, dtype=np.float32),
            np.ascontiguousarray(col_scale, dtype=np.float32),
            np.ascontiguousarray(weight, dtype=np.float32))
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if native.moe_scatter_add(c, *args, rows, out):
        return
    y = c.astype(np.float32) * args[1][None, :] * (args[0] * args[2])[:, None]
    np.add.at(out, rows, y)

"""Host-side quantization of routed experts into onnxruntime QMoE's packed layout.

The runtime only loads the packed arrays (:class:`ling3_rknn.npu.experts.PackedExperts`);
everything that touches float expert weights lives here. Symmetric round-to-nearest
absmax per block, the scheme the QMoE CPU kernel implies when no zero points are given.
The NPU's int8 copy (:class:`ling3_rknn.npu.matmul_experts.Int8MatmulExperts`) is
symmetric round-to-nearest absmax per output channel, laid out as the matmul's B.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ling3_rknn.npu.experts import PackedExperts
from ling3_rknn.npu.matmul_experts import Int8MatmulExperts, padded_sizes

_ZERO_POINT = {4: 8, 8: 128}
_QMAX = {4: 7, 8: 127}


def quantize_rows(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w [..., N, K]`` along K in blocks -> (packed uint8, float32 scales)."""
    if bits not in _QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k = w.shape[-1]
    if k % block_size:
        raise ValueError(f"input dimension {k} is not a multiple of block size {block_size}")
    blocks = w.astype(np.float32, copy=False).reshape(*w.shape[:-1], k // block_size, block_size)
    scales = np.abs(blocks).max(axis=-1) / _QMAX[bits]
    safe = np.where(scales > 0, scales, 1.0)[..., None]
    q = np.clip(np.rint(blocks / safe), -_QMAX[bits], _QMAX[bits]).astype(np.int16)
    codes: np.ndarray = (q + _ZERO_POINT[bits]).astype(np.uint8).reshape(*w.shape[:-1], k)
    if bits == 4:
        codes = (codes[..., 0::2] & 0x0F) | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(codes), scales.astype(np.float32)


def dequantize_rows(packed: np.ndarray, scales: np.ndarray, bits: int, block_size: int
                    ) -> np.ndarray:
    """Inverse of :func:`quantize_rows` (for references and error reports, not the hot path)."""
    if bits == 4:
        codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
        codes[..., 0::2] = packed & 0x0F
        codes[..., 1::2] = packed >> 4
    else:
        codes = packed
    q = codes.astype(np.float32) - _ZERO_POINT[bits]
    k = q.shape[-1]
    q = q.reshape(*q.shape[:-1], k // block_size, block_size) * scales[..., None]
    return q.reshape(*q.shape[:-2], k)


def quantize_experts(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, bits: int = 4, block_size: int = 32
) -> PackedExperts:
    """Float experts (gate/up ``[E, I, D]``, down ``[E, D, I]``) -> QMoE layout.

    Works one expert at a time so a bf16 checkpoint layer (300 M parameters at real size)
    never needs a second full float32 copy.
    """
    e, i, d = gate.shape
    if up.shape != (e, i, d) or down.shape != (e, d, i):
        raise ValueError(f"expert shapes disagree: gate {gate.shape} up {up.shape} "
                         f"down {down.shape}")
    return pack_experts(e, i, d, lambda x: (gate[x], up[x], down[x]), bits, block_size)


def pack_experts(count: int, inter: int, hidden: int,
                 load: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
                 bits: int = 4, block_size: int = 32) -> PackedExperts:
    """``load(x) -> (gate [I, D], up [I, D], down [D, I])`` of expert ``x``, called once per
    expert, so the caller can read each one from a checkpoint just in time."""
    per_byte = 8 // bits
    fc1_w = np.empty((count, 2 * inter, hidden // per_byte), np.uint8)
    fc1_s = np.empty((count, 2 * inter, hidden // block_size), np.float32)
    fc2_w = np.empty((count, hidden, inter // per_byte), np.uint8)
    fc2_s = np.empty((count, hidden, inter // block_size), np.float32)
    for x in range(count):
        gate, up, down = load(x)
        gw, gs = quantize_rows(gate, bits, block_size)
        uw, us = quantize_rows(up, bits, block_size)
        fc1_w[x, 0::2], fc1_w[x, 1::2] = gw, uw  # interleave: row 2j gate j, 2j+1 up j
        fc1_s[x, 0::2], fc1_s[x, 1::2] = gs, us
        fc2_w[x], fc2_s[x] = quantize_rows(down, bits, block_size)
    return PackedExperts(bits, block_size, fc1_w, fc1_s, fc2_w, fc2_s)


def dequantize_experts(packed: PackedExperts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate, up, down) float32 weights exactly as the quantized kernel sees them."""
    fc1 = dequantize_rows(packed.fc1_weight, packed.fc1_scales, packed.bits, packed.block_size)
    down = dequantize_rows(packed.fc2_weight, packed.fc2_scales, packed.bits, packed.block_size)
    return fc1[:, 0::2], fc1[:, 1::2], down


def quantize_columns(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """B ``[k, n]`` -> (int8 [k, n], float32 scales [n]): symmetric per output channel
    (column), scale max|b| / 127, round to nearest; an all-zero column gets scale 1."""
    b = b.astype(np.float32, copy=False)
    amax = np.abs(b).max(axis=0)
    scales = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(b / scales), -127, 127).astype(np.int8)
    return q, scales


def pack_matmul_experts(count: int, inter: int, hidden: int,
                        load: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]
                        ) -> Int8MatmulExperts:
    """The NPU's int8 copy (``Int8MatmulExperts``): ``load(x) -> (gate [I, D], up [I, D],
    down [D, I])`` of expert ``x``, called once per expert. Each projection becomes the
    matmul's B [k, n] (the weight transposed), zero-padded to int8's alignment."""
    dp, ip = padded_sizes(hidden, inter)
    gate_up = np.zeros((count, dp, 2 * ip), np.int8)
    gate_up_s = np.ones((count, 2 * ip), np.float32)
    down = np.zeros((count, ip, dp), np.int8)
    down_s = np.ones((count, dp), np.float32)
    for x in range(count):
        gate, up, dn = load(x)
        for col, w in ((0, gate), (ip, up)):
            q, s = quantize_columns(w.T)
            gate_up[x, :hidden, col:col + inter] = q
            gate_up_s[x, col:col + inter] = s
        q, s = quantize_columns(dn.T)
        down[x, :inter, :hidden] = q
        down_s[x, :hidden] = s
    return Int8MatmulExperts(hidden, inter, gate_up, gate_up_s, down, down_s)


def dequantize_matmul_experts(packed: Int8MatmulExperts
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate [E, I, D], up [E, I, D], down [E, D, I]) float32 as the int8 copy holds them."""
    d, i = packed.hidden, packed.intermediate
    ip = padded_sizes(d, i)[1]
    gu = packed.gate_up.astype(np.float32) * packed.gate_up_scales[:, None, :]
    dn = packed.down.astype(np.float32) * packed.down_scales[:, None, :]
    gate = gu[:, :d, :i].transpose(0, 2, 1)
    up = gu[:, :d, ip:ip + i].transpose(0, 2, 1)
    return gate, up, dn[:, :i, :d].transpose(0, 2, 1)

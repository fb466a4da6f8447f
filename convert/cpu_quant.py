"""Weight-only int8/int4 stage graphs for ``--target cpu``: every constant 2-D MatMul
becomes onnxruntime's ``com.microsoft::MatMulNBits``.

A decode step on the CPU is a memory-traffic problem: the fp32 stage graphs read 4 bytes
per weight per token, MatMulNBits int8 with block-32 scales 1.125 (int4: 0.625), and its
accuracy-level-4 kernels quantize the activations to int8 and use the integer dot-product
instructions (AVX2/AVX-VNNI on x86, SDOT/I8MM on the RK3588's A76). onnxruntime's own
quantizer does the rewrite (``MatMulNBitsQuantizer``), so the packing always matches the
kernel of the installed onnxruntime. The batched per-head products of MLA (3-D weights)
stay fp32; they are small. ``convert/cpu_graph.py`` then merges the graph into fewer,
larger nodes for onnxruntime (one MatMulNBits per input, fused RMSNorm).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from convert.cpu_graph import fuse_for_cpu


def quantize_matmuls(src: Path, *, bits: int, block_size: int, accuracy_level: int,
                     fuse: bool = True) -> onnx.ModelProto:
    """The fp32 graph at ``src`` (external data next to it) with its 2-D constant MatMuls
    as symmetric ``bits``-bit MatMulNBits, fused for onnxruntime (``fuse_for_cpu``,
    unless ``fuse`` is false); returns the model with every weight inline."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    # its per-node INFO lines ("skip to quantize logits ...") would flood the convert log
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    if bits not in (4, 8):
        raise ValueError(f"MatMulNBits bits must be 4 or 8, got {bits}")
    model = onnx.load(str(src), load_external_data=True)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                          accuracy_level=accuracy_level, bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size,
                                     is_symmetric=True, accuracy_level=accuracy_level,
                                     algo_config=config)
    quantizer.process()
    return fuse_for_cpu(quantizer.model.model) if fuse else quantizer.model.model

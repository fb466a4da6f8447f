"""The host twin of a w8a8 stage: the fp32 graph with QuantizeLinear/DequantizeLinear pairs.

On the board rknn-toolkit2 runs the stage with int8 weights (per output channel) and int8
activations (per tensor, asymmetric, ranges from the calibration set). The host mock must
show the same error, so the ONNX twin next to a w8a8 ``.rknn`` is quantized the same way
by onnxruntime's own static quantizer (a maintained implementation of exactly this
scheme) from the same calibration samples, rather than by hand-written rounding.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx


class _Reader:
    """onnxruntime's CalibrationDataReader over ``[N, 1, T, W]`` samples per input."""

    def __init__(self, samples: Mapping[str, np.ndarray]) -> None:
        count = len(next(iter(samples.values())))
        self._it: Iterator[dict[str, np.ndarray]] = iter(
            [{k: np.ascontiguousarray(v[n], np.float32) for k, v in samples.items()}
             for n in range(count)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def quantize_twin(source: str | Path, samples: Mapping[str, np.ndarray],
                  exclude_prefixes: tuple[str, ...] = ()) -> onnx.ModelProto:
    """QDQ version of ``model``: int8 per-channel weights, uint8 per-tensor activations;
    MatMuls whose weight name starts with one of ``exclude_prefixes`` stay float.
    ``source``: the fp32 graph's path (its external data, if any, next to it)."""
    model = onnx.load(str(source), load_external_data=False)
    excluded = [n.name for n in model.graph.node if n.op_type == "MatMul" and any(
        i.startswith(exclude_prefixes) for i in n.input)] if exclude_prefixes else []
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    with tempfile.TemporaryDirectory(prefix="ling3-w8a8-") as tmp:
        dst = Path(tmp) / "w8a8.onnx"
        quantize_static(
            str(source), str(dst), _Reader(samples),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul"],
            nodes_to_exclude=excluded,
            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False},
        )
        return onnx.load(str(dst))

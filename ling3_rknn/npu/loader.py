"""Open an executor from files: a stage graph on its runtime, a QMoE expert layer, a
layer's int8 copy for the NPU's matmuls.

Paths and choices come from the caller (``ling3_rknn.model.bundle_executors`` reads them
from a bundle's manifest and placement plan); this module knows files and runtimes, not
bundles.
"""

from __future__ import annotations

import os

from safetensors import safe_open
from safetensors.numpy import load_file

from ling3_rknn.npu.errors import ExpertError
from ling3_rknn.npu.executors import (
    GraphExecutor,
    GraphSpec,
    OnnxExecutor,
    RknnLiteExecutor,
    resolve_rknnlite,
)
from ling3_rknn.npu.experts import PackedExperts, QMoeExperts
from ling3_rknn.npu.matmul_experts import Int8MatmulExperts

QMOE_BITS = {"int4": 4, "int8": 8}

PathLike = str | os.PathLike[str]


def open_graph(spec: GraphSpec, onnx: PathLike, rknn: PathLike | None = None, *,
               core_mask: str | int = "auto", runtime: str | None = None,
               rknnlite_cls: type | None = None, threads: int = 1) -> GraphExecutor:
    """RKNNLite on ``rknn`` (``runtime``: ``None``/``"auto"``/``"board"``/``"mock"``, see
    :func:`resolve_rknnlite`), or plain onnxruntime on the ONNX twin when there is no
    ``rknn`` or ``runtime`` is ``"onnx"``."""
    if rknn is None or runtime == "onnx":
        return OnnxExecutor(onnx, spec, threads=threads)
    if rknnlite_cls is None and runtime is not None:
        rknnlite_cls = resolve_rknnlite(runtime)
    return RknnLiteExecutor(rknn, spec, core_mask=core_mask, rknnlite_cls=rknnlite_cls)


def open_qmoe_experts(fmt: str, weights: PathLike, graph: PathLike, top_k: int, *,
                      label: str, threads: int = 2) -> QMoeExperts:
    """The QMoE executor of one layer after checking its packed weights agree with
    ``fmt`` (int4 | int8) and ``top_k``; ``label`` names the weights file in errors."""
    with safe_open(str(weights), framework="numpy") as f:
        missing = set(PackedExperts.TENSOR_NAMES) - set(f.keys())
        if missing:
            raise ExpertError(f"{label} lacks tensors {sorted(missing)}")
        num_experts, hidden, _ = f.get_slice("fc2_weight").get_shape()
        packed_hidden = f.get_slice("fc1_weight").get_shape()[2]
    if packed_hidden * 8 != hidden * QMOE_BITS[fmt]:
        raise ExpertError(f"{label} is not {fmt}: fc1 rows hold {packed_hidden} bytes for "
                          f"hidden size {hidden}")
    if top_k > num_experts:
        raise ExpertError(f"top_k {top_k} exceeds {num_experts} experts")
    return QMoeExperts(graph, hidden_size=hidden, num_experts=num_experts, top_k=top_k,
                       threads=threads)


def read_int8_experts(weights: PathLike, *, hidden: int, intermediate: int, label: str
                      ) -> Int8MatmulExperts:
    """One MoE layer's int8 copy for the NPU from its safetensors file; every way the file
    can be wrong (not safetensors, a missing tensor, a shape or dtype off) is an
    ``ExpertError`` naming ``label``."""
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # safetensors raises its own errors for a damaged file
        raise ExpertError(f"{label}: not a readable safetensors file: {exc}") from exc
    try:
        return Int8MatmulExperts.from_tensors(tensors, hidden, intermediate)
    except ExpertError as exc:
        raise ExpertError(f"{label}: {exc}") from exc

"""Executors for the work the model hands out: NPU stage graphs and CPU routed experts.

A leaf: it knows graphs, tensors and files, never the bundle format or the model.
"""

from ling3_rknn.npu.errors import ExpertError, NpuError, NpuInputError
from ling3_rknn.npu.executors import (
    CORE_MASKS,
    GraphExecutor,
    GraphSpec,
    OnnxExecutor,
    RknnLiteExecutor,
    check_inputs,
    resolve_rknnlite,
)
from ling3_rknn.npu.experts import ExpertExecutor, PackedExperts, QMoeExperts
from ling3_rknn.npu.loader import open_graph, open_qmoe_experts
from ling3_rknn.npu.rknnlite_mock import MockRKNNLite

__all__ = [
    "CORE_MASKS",
    "ExpertError",
    "ExpertExecutor",
    "GraphExecutor",
    "GraphSpec",
    "MockRKNNLite",
    "NpuError",
    "NpuInputError",
    "OnnxExecutor",
    "PackedExperts",
    "QMoeExperts",
    "RknnLiteExecutor",
    "check_inputs",
    "open_graph",
    "open_qmoe_experts",
    "resolve_rknnlite",
]

"""Executors for the work the model hands out: NPU stage graphs and CPU routed experts."""

from ling3_rknn.npu.errors import ExpertError, NpuError, NpuInputError
from ling3_rknn.npu.executors import (
    CORE_MASKS,
    GraphExecutor,
    OnnxExecutor,
    RknnLiteExecutor,
    check_inputs,
    resolve_rknnlite,
)
from ling3_rknn.npu.experts import ExpertExecutor, FloatExperts, PackedExperts, QMoeExperts
from ling3_rknn.npu.loader import open_experts, open_stage
from ling3_rknn.npu.rknnlite_mock import MockRKNNLite

__all__ = [
    "CORE_MASKS",
    "ExpertError",
    "ExpertExecutor",
    "FloatExperts",
    "GraphExecutor",
    "MockRKNNLite",
    "NpuError",
    "NpuInputError",
    "OnnxExecutor",
    "PackedExperts",
    "QMoeExperts",
    "RknnLiteExecutor",
    "check_inputs",
    "open_experts",
    "open_stage",
    "resolve_rknnlite",
]

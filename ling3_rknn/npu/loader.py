"""Executors for a bundle's stages and expert layers, as its manifest and plan say.

The model asks for work by name (``open_stage(bundle, "layer.3.in")``,
``open_experts(bundle, 3)``); which runtime, which cores and which expert kernel follow
from the manifest alone, so re-tuning the plan needs no code change.
"""

from __future__ import annotations

from safetensors import safe_open
from safetensors.numpy import load_file

from ling3_rknn.bundle import Bundle
from ling3_rknn.npu.errors import ExpertError, NpuError
from ling3_rknn.npu.executors import GraphExecutor, OnnxExecutor, RknnLiteExecutor
from ling3_rknn.npu.experts import ExpertExecutor, FloatExperts, PackedExperts, QMoeExperts


def open_stage(bundle: Bundle, name: str, runtime: str | None = None,
               rknnlite_cls: type | None = None, threads: int = 1) -> GraphExecutor:
    """``runtime``: ``None``/``"auto"``/``"board"``/``"mock"`` drive RKNNLite for an rk3588
    bundle (see :func:`resolve_rknnlite`); ``"onnx"`` or a ``cpu`` bundle run the ONNX
    twin directly."""
    spec = bundle.manifest.stages.get(name)
    if spec is None:
        raise NpuError(f"bundle has no stage {name!r}")
    if bundle.manifest.target == "cpu" or runtime == "onnx" or spec.rknn is None:
        return OnnxExecutor(bundle.path(spec.onnx), spec, threads=threads)
    if rknnlite_cls is None and runtime is not None:
        from ling3_rknn.npu.executors import resolve_rknnlite

        rknnlite_cls = resolve_rknnlite(runtime)
    core = bundle.manifest.placement.stage_cores.get(name, "auto")
    return RknnLiteExecutor(bundle.path(spec.rknn), spec, core_mask=core,
                            rknnlite_cls=rknnlite_cls)


def open_experts(bundle: Bundle, layer: int, threads: int = 2) -> ExpertExecutor:
    """The routed experts of MoE ``layer``: QMoE for int4/int8, numpy for fp16."""
    spec = bundle.manifest.experts
    if spec is None or layer not in spec.layers:
        raise ExpertError(f"bundle has no routed experts for layer {layer}")
    entry = spec.layers[layer]
    if "weights" not in entry:
        raise ExpertError(f"experts.layers.{layer} names no weights file")
    weights = bundle.path(entry["weights"])
    if spec.format == "fp16":
        tensors = load_file(str(weights))
        missing = {"gate", "up", "down"} - set(tensors)
        if missing:
            raise ExpertError(f"{entry['weights']} lacks tensors {sorted(missing)}")
        return FloatExperts(tensors["gate"], tensors["up"], tensors["down"], spec.top_k)
    if "onnx" not in entry:
        raise ExpertError(f"experts.layers.{layer} names no QMoE graph")
    with safe_open(str(weights), framework="numpy") as f:
        names = set(f.keys())
        missing = set(PackedExperts.TENSOR_NAMES) - names
        if missing:
            raise ExpertError(f"{entry['weights']} lacks tensors {sorted(missing)}")
        num_experts, hidden, _ = f.get_slice("fc2_weight").get_shape()
        packed_hidden = f.get_slice("fc1_weight").get_shape()[2]
    bits = {"int4": 4, "int8": 8}[spec.format]
    if packed_hidden * 8 != hidden * bits:
        raise ExpertError(f"{entry['weights']} is not {spec.format}: fc1 rows hold "
                          f"{packed_hidden} bytes for hidden size {hidden}")
    if spec.top_k > num_experts:
        raise ExpertError(f"top_k {spec.top_k} exceeds {num_experts} experts")
    return QMoeExperts(bundle.path(entry["onnx"]), hidden_size=hidden,
                       num_experts=num_experts, top_k=spec.top_k, threads=threads)


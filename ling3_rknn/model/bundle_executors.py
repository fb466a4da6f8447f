"""Executors for a bundle's stages and expert layers, as its manifest and plan say.

The model asks for work by name (``open_stage(bundle, "layer.3.in")``,
``open_experts(bundle, 3)``); which runtime, which cores and which expert kernel follow
from the manifest alone, so re-tuning the plan needs no code change. The executors
themselves (``ling3_rknn.npu``) know files and graphs, not bundles.
"""

from __future__ import annotations

from safetensors.numpy import load_file

from ..bundle import PLACEHOLDER_MAGIC, Bundle
from ..npu import ExpertError, ExpertExecutor, GraphExecutor, MockRKNNLite, NpuError
from ..npu.loader import open_graph, open_qmoe_experts
from .float_experts import FloatExperts


def open_stage(bundle: Bundle, name: str, runtime: str | None = None,
               rknnlite_cls: type | None = None, threads: int = 1) -> GraphExecutor:
    """``runtime``: ``None``/``"auto"``/``"board"``/``"mock"`` drive RKNNLite for an rk3588
    bundle (see ``ling3_rknn.npu.resolve_rknnlite``); ``"onnx"`` or a ``cpu`` bundle run
    the ONNX twin directly."""
    spec = bundle.manifest.stages.get(name)
    if spec is None:
        raise NpuError(f"bundle has no stage {name!r}")
    rknn = None if bundle.manifest.target == "cpu" or spec.rknn is None \
        else bundle.path(spec.rknn)
    return open_graph(spec, bundle.path(spec.onnx), rknn,
                      core_mask=bundle.manifest.placement.stage_cores.get(name, "auto"),
                      runtime=runtime, rknnlite_cls=rknnlite_cls, threads=threads)


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
    return open_qmoe_experts(spec.format, weights, bundle.path(entry["onnx"]), spec.top_k,
                             label=entry["weights"], threads=threads)


def check_not_placeholder(bundle: Bundle, name: str, rknnlite_cls: type | None) -> None:
    """A real RKNNLite must never be handed the stand-in ``.rknn`` of a conversion
    without rknn-toolkit2 (only the mock, which runs the ONNX twin, can use those)."""
    spec = bundle.manifest.stages[name]
    if spec.rknn is None or rknnlite_cls is None or rknnlite_cls is MockRKNNLite:
        return
    with open(bundle.path(spec.rknn), "rb") as f:
        if f.read(len(PLACEHOLDER_MAGIC)) == PLACEHOLDER_MAGIC:
            raise NpuError(f"{spec.rknn} is a placeholder from a conversion without "
                           "rknn-toolkit2; re-convert with the toolkit for the board")

"""Executors for a bundle's stages and expert layers, as its manifest and plan say.

The model asks for work by name (``open_stage(bundle, "layer.3.in")``,
``open_experts(bundle, 3)``); which runtime, which cores and which expert kernel follow
from the manifest alone, so re-tuning the plan needs no code change. The executors
themselves (``ling3_rknn.npu``) know files and graphs, not bundles.
"""

from __future__ import annotations

from safetensors.numpy import load_file

from ..bundle import PLACEHOLDER_MAGIC, Bundle
from ..config import ModelConfig
from ..npu import ExpertError, ExpertExecutor, GraphExecutor, MockRKNNLite, NpuError
from ..npu.loader import open_graph, open_qmoe_experts, read_int8_experts
from ..npu.matmul_experts import Int8MatmulExperts, MatmulExpertStore, NpuLayerExperts
from . import moe_int8, native
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


def open_npu_matmul_experts(bundle: Bundle, cfg: ModelConfig, runtime: str | None = None
                            ) -> tuple[MatmulExpertStore, dict[int, NpuLayerExperts]]:
    """The routed experts' int8 copy written into NPU memory, and an executor per MoE
    layer. ``runtime``: the matmul library (``ling3_rknn.npu.matmul.resolve_library``:
    board | mock | None for auto)."""
    from ..npu.matmul import open_runtime

    spec = bundle.manifest.npu_matmul_experts
    if spec is None:
        raise ExpertError("the bundle has no int8 copy of the routed experts for the NPU "
                          "(converted without --npu-experts, or before it existed)")
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    missing = sorted(set(moe) - set(spec.layers))
    if missing:
        raise ExpertError(f"the NPU experts' int8 copy lacks MoE layers {missing}")

    def load(layer: int) -> Int8MatmulExperts:
        rel = spec.layers[layer]
        return read_int8_experts(bundle.path(rel), hidden=cfg.hidden_size,
                                 intermediate=cfg.moe_intermediate_size, label=rel)

    matmul = open_runtime(runtime)
    try:
        store = MatmulExpertStore(matmul, moe, load, hidden=cfg.hidden_size,
                                  intermediate=cfg.moe_intermediate_size,
                                  num_experts=cfg.num_experts)
    except BaseException:
        matmul.close()
        raise
    # the activation steps compiled (moe_int8.c) where the kernels load, else numpy's
    act = moe_int8 if native.available() else None
    return store, {i: NpuLayerExperts(store, i, cfg.num_experts, cfg.num_experts_per_tok,
                                      activations=act)
                   for i in moe}


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

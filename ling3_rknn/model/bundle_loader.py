"""``Model.from_bundle``: build the model's seams from a verified bundle.

Everything follows the manifest: which graphs exist, which runtime and cores run them,
the expert format, the NPU experts of the placement plan. The CPU glue is the same code
as for ``Model.from_hf``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np

from ..bundle import Bundle, BundleError, VerifyMode
from ..config import ModelConfig
from ..npu import GraphExecutor, NpuError, open_experts, open_stage
from ..npu.executors import resolve_rknnlite
from ..npu.rknnlite_mock import MockRKNNLite
from .bundle_stages import BundleExperts, GraphStages
from .safetensors_file import CheckpointError, SafetensorsFile

ExecutorChoice = Literal["auto", "rknnlite", "mock", "onnx"]
_RUNTIME = {"auto": None, "rknnlite": "board", "mock": "mock", "onnx": "onnx"}
# Written by ``convert --no-rknn-build`` (convert/converter.py): usable by the mock only.
PLACEHOLDER_MAGIC = b"LING3-RKNN-PLACEHOLDER\n"


def _cpu_weights(bundle: Bundle, cfg: ModelConfig) -> tuple[SafetensorsFile, dict, dict]:
    try:
        f = SafetensorsFile(bundle.path(bundle.manifest.weights))
        f.shape("embedding")
        conv = {i: np.ascontiguousarray(f.float32(f"conv.{i}")) for i in cfg.kda_layers}
        bias = {i: np.array(f.float32(f"expert_bias.{i}"))
                for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
    except (KeyError, CheckpointError) as exc:
        raise BundleError(f"{bundle.manifest.weights}: {exc}") from exc
    if f.shape("embedding") != (cfg.vocab_size, cfg.hidden_size):
        raise BundleError(f"{bundle.manifest.weights}: embedding has shape "
                          f"{list(f.shape('embedding'))}, config says "
                          f"{[cfg.vocab_size, cfg.hidden_size]}")
    return f, conv, bias


def _check_not_placeholder(bundle: Bundle, name: str, rknnlite_cls: type | None) -> None:
    spec = bundle.manifest.stages[name]
    if spec.rknn is None or rknnlite_cls is None or rknnlite_cls is MockRKNNLite:
        return
    with open(bundle.path(spec.rknn), "rb") as f:
        if f.read(len(PLACEHOLDER_MAGIC)) == PLACEHOLDER_MAGIC:
            raise NpuError(f"{spec.rknn} is a placeholder from a conversion without "
                           "rknn-toolkit2; re-convert with the toolkit for the board")


def load_from_bundle(path: str | os.PathLike[str], executor: ExecutorChoice = "auto",
                     verify: VerifyMode = "stamped", threads: int = 2):  # -> Model
    """The pieces of a ``Model`` from the bundle at ``path`` (see ``Model.from_bundle``)."""
    from ..config import ConfigError
    from .model import CpuWeights, Model

    if executor not in _RUNTIME:
        raise ValueError(f"executor must be one of {list(_RUNTIME)}, got {executor!r}")
    if isinstance(path, Bundle):
        bundle = path
        if verify != "none":
            bundle.verify(verify)
    else:
        bundle = Bundle.open(Path(path), verify=verify)
    m = bundle.manifest
    try:
        cfg = ModelConfig.from_dict(m.model_config)
    except ConfigError as exc:
        raise BundleError(f"manifest model_config: {exc}") from exc
    runtime = _RUNTIME[executor]
    rknnlite_cls = None
    if m.target == "rk3588" and runtime != "onnx":
        rknnlite_cls = resolve_rknnlite(runtime)
    executors: dict[str, GraphExecutor] = {}
    try:
        for name in m.stages:
            _check_not_placeholder(bundle, name, rknnlite_cls)
            executors[name] = open_stage(bundle, name, runtime=runtime,
                                         rknnlite_cls=rknnlite_cls, threads=threads)
        missing = [f"layer.{i}.{r}" for i in range(cfg.num_hidden_layers) for r in ("in", "out")
                   if f"layer.{i}.{r}" not in executors] + (
            [] if "final" in executors else ["final"])
        if missing:
            raise BundleError(f"bundle lacks stage graphs {missing}")
        weights, conv, bias = _cpu_weights(bundle, cfg)
        stages = GraphStages(cfg, executors, weights, m.chunk_sizes[0])
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        cpu = {i: open_experts(bundle, i, threads=threads) for i in moe}
        npu = {layer: {e: executors[f"layer.{layer}.expert.{e}"] for e in ids}
               for layer, ids in m.placement.npu_experts.items()}
    except BaseException:
        for ex in executors.values():
            ex.close()
        raise
    model = Model(cfg, stages, BundleExperts(cpu, npu, stages), CpuWeights(conv, bias),
                  threads=threads)
    model.bundle = bundle
    return model

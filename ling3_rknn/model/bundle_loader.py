"""The pieces ``Model.from_bundle`` builds a model from, read from an opened bundle.

Everything follows the manifest: which graphs exist, which runtime and cores run them,
the expert format, the NPU experts of the placement plan. The CPU glue is the same code
as for ``Model.from_hf``. This module never imports ``model.py``: the model calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..bundle import (
    EMBEDDING_KEY,
    Bundle,
    BundleError,
    StageName,
    conv_key,
    expert_bias_key,
    mla_key_basis_key,
    mla_value_basis_key,
)
from ..config import ConfigError, ModelConfig
from ..npu import ExpertExecutor, GraphExecutor, MockRKNNLite, resolve_rknnlite
from ..npu.matmul_experts import MatmulExpertStore
from .bundle_executors import (
    check_not_placeholder,
    open_experts,
    open_npu_matmul_experts,
    open_stage,
)
from .bundle_stages import BundleExperts, GraphStages
from .cpu_weights import CpuWeights
from .mla_expanded import MlaBases
from .safetensors_file import CheckpointError, SafetensorsFile

ExecutorChoice = Literal["auto", "rknnlite", "mock", "onnx"]
_RUNTIME = {"auto": None, "rknnlite": "board", "mock": "mock", "onnx": "onnx"}
# The matmul library (``ling3_rknn.npu.matmul.resolve_library``) per executor choice: the
# board's librknnrt, or the host stand-in wherever the graphs do not run on the board.
_MATMUL_RUNTIME = {"auto": None, "rknnlite": "board", "mock": "mock", "onnx": "mock"}


@dataclass(frozen=True)
class BundleParts:
    """The ``Model`` constructor's arguments, as a bundle provides them."""

    config: ModelConfig
    stages: GraphStages
    experts: BundleExperts
    cpu: CpuWeights
    npu_graphs: bool = False  # the stages run from their .rknn files (the real RKNNLite)
    # the routed experts' int8 copy on the NPU's matmuls for prefill pieces (None: not loaded)
    npu_matmul_experts: MatmulExpertStore | None = None


def runtime_for(executor: str) -> str | None:
    """The NPU runtime (``resolve_rknnlite``'s choice, or ``"onnx"``) of an executor choice."""
    if executor not in _RUNTIME:
        raise ValueError(f"executor must be one of {list(_RUNTIME)}, got {executor!r}")
    return _RUNTIME[executor]


def _cpu_weights(bundle: Bundle, cfg: ModelConfig) -> tuple[SafetensorsFile, CpuWeights]:
    try:
        f = SafetensorsFile(bundle.path(bundle.manifest.weights))
        f.shape(EMBEDDING_KEY)
        conv = {i: np.ascontiguousarray(f.float32(conv_key(i))) for i in cfg.kda_layers}
        bias = {i: np.array(f.float32(expert_bias_key(i)))
                for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
        bases = _mla_bases(f, cfg)
    except (KeyError, CheckpointError) as exc:
        raise BundleError(f"{bundle.manifest.weights}: {exc}") from exc
    if f.shape(EMBEDDING_KEY) != (cfg.vocab_size, cfg.hidden_size):
        raise BundleError(f"{bundle.manifest.weights}: embedding has shape "
                          f"{list(f.shape(EMBEDDING_KEY))}, config says "
                          f"{[cfg.vocab_size, cfg.hidden_size]}")
    return f, CpuWeights(conv, bias, bases)


def _mla_bases(f: SafetensorsFile, cfg: ModelConfig) -> dict[int, MlaBases]:
    """The expanded prefill form's bases, when the bundle has them (converted since they
    exist; without them prefill attention stays absorbed). Shapes are checked: a basis of
    the wrong size would silently compute wrong attention."""
    names = set(f.names())
    keys = [(i, mla_key_basis_key(i), mla_value_basis_key(i)) for i in cfg.mla_layers]
    if not all(k in names and v in names for _, k, v in keys):
        return {}
    h, r = cfg.num_attention_heads, cfg.kv_lora_rank
    bases = {}
    for i, k, v in keys:
        for name, width in ((k, cfg.qk_nope_head_dim), (v, cfg.v_head_dim)):
            if f.shape(name) != (h, r, width):
                raise BundleError(f"weights.safetensors: {name} has shape {list(f.shape(name))}"
                                  f", config says {[h, r, width]}")
        bases[i] = MlaBases(np.ascontiguousarray(f.float32(k)), np.ascontiguousarray(f.float32(v)))
    return bases


def load_bundle_parts(bundle: Bundle, executor: ExecutorChoice = "auto", threads: int = 2,
                      npu_experts: bool = False) -> BundleParts:
    """Open every stage graph and expert layer of ``bundle`` (already verified);
    ``npu_experts``: also write the routed experts' int8 copy into NPU memory for prefill
    (the memory plan's choice, made by the caller; a bundle without the copy is an error)."""
    runtime = runtime_for(executor)
    m = bundle.manifest
    try:
        cfg = ModelConfig.from_dict(m.model_config)
    except ConfigError as exc:
        raise BundleError(f"manifest model_config: {exc}") from exc
    rknnlite_cls = None
    if m.target == "rk3588" and runtime != "onnx":
        rknnlite_cls = resolve_rknnlite(runtime)
    executors: dict[str, GraphExecutor] = {}
    store: MatmulExpertStore | None = None
    prefill: dict[int, ExpertExecutor] = {}
    try:
        for name in m.stages:
            check_not_placeholder(bundle, name, rknnlite_cls)
            executors[name] = open_stage(bundle, name, runtime=runtime,
                                         rknnlite_cls=rknnlite_cls, threads=threads)
        needed = [str(n) for i in range(cfg.num_hidden_layers)
                  for n in (StageName.layer_in(i), StageName.layer_out(i))]
        missing = [n for n in [*needed, str(StageName.final())] if n not in executors]
        if missing:
            raise BundleError(f"bundle lacks stage graphs {missing}")
        weights, cpu_weights = _cpu_weights(bundle, cfg)
        stages = GraphStages(cfg, executors, weights, m.chunk_sizes)
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        cpu = {i: open_experts(bundle, i, threads=threads) for i in moe}
        npu = {layer: {e: executors[str(StageName.npu_expert(layer, e))] for e in ids}
               for layer, ids in m.placement.npu_experts.items()}
        if npu_experts:
            store, layers = open_npu_matmul_experts(bundle, cfg, _MATMUL_RUNTIME[executor])
            prefill = dict(layers)
    except BaseException:
        for ex in executors.values():
            ex.close()
        raise
    on_npu = rknnlite_cls is not None and rknnlite_cls is not MockRKNNLite
    return BundleParts(cfg, stages, BundleExperts(cpu, npu, stages, prefill=prefill),
                       cpu_weights, on_npu, store)

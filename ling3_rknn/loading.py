"""Build a serving ``Engine`` from a bundle or an HF checkpoint.

One place for what the model brings to the engine: the served id, a context limit that fits
the board's memory unless the caller says otherwise, the sampling defaults of the model's
generation config, and the weights identity that keeps persisted prefix-cache files from
ever being reused by other weights. ``ling3-rknn serve`` and the embedded demo both load
through here, so the default model is served exactly the way a user's bundle is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ling3_rknn.memory_plan import (
    MemoryPlan,
    NpuExpertsChoice,
    choose_npu_experts,
    machine_memory,
    plan_memory,
    read_meminfo,
)

if TYPE_CHECKING:
    from ling3_rknn.bundle import Bundle
    from ling3_rknn.engine import Engine, EngineOptions, TokenizerLike
    from ling3_rknn.model import Model

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "ling-3.0-tiny"
# The MLA latent cache grows with the context; 32K fits the CM3588's RAM next to the model.
DEFAULT_MAX_CONTEXT = 32768
# auto | on | off: the routed experts' int8 copy for prefill on the NPU (``--npu-experts``;
# auto: where the memory plan allows it). For tests and measurements.
NPU_EXPERTS_ENV = "LING3_RKNN_NPU_EXPERTS"
NPU_EXPERTS_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class LoadOptions:
    """What the operator set (``serve``'s flags); None: what the model brings, else the
    engine's default (``EngineOptions``)."""

    model_id: str | None = None
    max_context: int | None = None  # None: the model's limit, at most DEFAULT_MAX_CONTEXT
    cache_bytes: int | None = None
    cache_dir: Path | None = None
    max_queue: int | None = None
    default_max_tokens: int | None = None  # 0: no cap but the context
    grammar_cache_bytes: int | None = None
    prefill_scratch_bytes: int | None = None  # the model's (``Model``), not the engine's
    npu_prefill: str = "auto"  # prefill attention on the NPU: auto | on | off (``mla_npu``)
    npu_experts: str | None = None  # auto | on | off; None: $LING3_RKNN_NPU_EXPERTS, else auto


def engine_options(
    options: LoadOptions,
    max_position_embeddings: int,
    *,
    generation_config: dict[str, Any] | None = None,
    weights_identity: str | None = None,
    default_model_id: str = DEFAULT_MODEL_ID,
) -> EngineOptions:
    """The engine's options: what the operator set wins over what the model brings (see
    the module docstring); what neither says keeps the engine's default."""
    from ling3_rknn.engine import EngineOptions, defaults_from_generation_config

    limit = max_position_embeddings
    if options.max_context is not None and options.max_context > limit:
        # Advertising more would let prompts through that the model then fails on.
        raise ValueError(f"--max-context {options.max_context} is beyond what the model "
                         f"supports (max_position_embeddings {limit})")
    base = EngineOptions(
        model_id=_given(options.model_id, default_model_id),
        max_context=_given(options.max_context, min(limit, DEFAULT_MAX_CONTEXT)),
    )
    cap = options.default_max_tokens
    return replace(
        base,
        cache_bytes=_given(options.cache_bytes, base.cache_bytes),
        cache_dir=options.cache_dir,
        max_queue=_given(options.max_queue, base.max_queue),
        grammar_cache_bytes=_given(options.grammar_cache_bytes, base.grammar_cache_bytes),
        weights_identity=weights_identity,
        default_max_tokens=base.default_max_tokens if cap is None else (cap or None),
        generation_defaults=(defaults_from_generation_config(generation_config)
                             if generation_config else base.generation_defaults),
        eos_token_ids=(tuple(_eos_ids(generation_config)) if generation_config
                       else base.eos_token_ids),
    )


def _given(value: T | None, default: T) -> T:
    return default if value is None else value


def make_engine(
    model: Model,
    tokenizer: TokenizerLike,
    options: LoadOptions,
    *,
    generation_config: dict[str, Any] | None = None,
    weights_identity: str | None = None,
    default_model_id: str = DEFAULT_MODEL_ID,
    npu_experts: NpuExpertsChoice | None = None,
) -> Engine:
    """The engine for ``model``: ``options`` (as the CLI collected them) win over what the
    model brings (see the module docstring). ``npu_experts``: the int8 expert copy's
    choice, for the memory plan's report."""
    from ling3_rknn.engine import Engine

    resolved = engine_options(
        options, model.config.max_position_embeddings, generation_config=generation_config,
        weights_identity=weights_identity, default_model_id=default_model_id)
    # a bundle converted with bigger prefill graphs is fed in pieces of the biggest
    resolved = replace(resolved, prefill_chunk=model.prefill_chunk)
    plan = memory_plan_for(model, options, resolved.max_context, npu_experts=npu_experts)
    log.info("%s", plan.describe())
    for warning in plan.warnings():
        log.warning("memory: %s", warning)
    model.prefill_scratch_bytes = plan.prefill_scratch_bytes
    # the disk tier holds no memory: a cache sized down here keeps the default disk budget
    disk = resolved.cache_disk_bytes
    if disk is None and "cache" in plan.auto:
        disk = 4 * resolved.cache_bytes
    engine = Engine(model, tokenizer,
                    replace(resolved, cache_bytes=plan.cache_bytes, cache_disk_bytes=disk))
    engine.memory_plan = plan
    return engine


def memory_plan_for(model: Model, options: LoadOptions, max_context: int,
                    meminfo: dict[str, int] | None = None,
                    npu_experts: NpuExpertsChoice | None = None) -> MemoryPlan:
    """The prefix cache's and the prefill scratch's sizes for this machine
    (``ling3_rknn.memory_plan``): the operator's values, else what the memory left
    beside the model allows, at most the defaults. ``meminfo``: None reads the machine's
    (``memory_plan.machine_memory``: its cgroup limit included)."""
    from ling3_rknn.engine.options import DEFAULT_CACHE_BYTES
    from ling3_rknn.model.mla_expanded import PREFILL_SCRATCH_BYTES
    from ling3_rknn.model.state import StateLayout

    return plan_memory(
        model_bytes=_model_bytes(model),
        sequence_bytes=StateLayout.from_config(model.config, model.latent_dtype).nbytes(
            max_context),
        meminfo=machine_memory() if meminfo is None else meminfo,
        cache_bytes=options.cache_bytes,
        prefill_scratch_bytes=options.prefill_scratch_bytes,
        default_cache_bytes=DEFAULT_CACHE_BYTES,
        default_prefill_scratch_bytes=PREFILL_SCRATCH_BYTES,
        npu_experts=npu_experts,
        scratch_first_bytes=_npu_rows_bytes(model, max_context),
    )


def _npu_rows_bytes(model: Model, max_context: int) -> int:
    """The NPU attention's rows for a prompt at the context limit and its layers'
    projections (0 without it)."""
    attention = model.npu_attention
    bases = model.cpu.mla_bases
    if attention is None or not bases:
        return 0
    first = next(iter(bases.values()))
    rows = attention.bytes_for(first, model.config.qk_rope_head_dim, max_context)
    return (rows + attention.projection_bytes()) * len(bases)


def npu_experts_setting(options: LoadOptions) -> bool | None:
    """``--npu-experts``, else ``$LING3_RKNN_NPU_EXPERTS``: True (on), False (off) or None
    (auto: the memory plan decides)."""
    value = options.npu_experts or os.environ.get(NPU_EXPERTS_ENV) or "auto"
    if value not in NPU_EXPERTS_CHOICES:
        raise ValueError(f"NPU experts must be one of {', '.join(NPU_EXPERTS_CHOICES)}, got "
                         f"{value!r} (--npu-experts / ${NPU_EXPERTS_ENV})")
    return None if value == "auto" else value == "on"


def npu_experts_choice(bundle: Bundle, options: LoadOptions, latent_dtype: str = "float32",
                       meminfo: dict[str, int] | None = None) -> NpuExpertsChoice:
    """Whether ``bundle``'s int8 expert copy is loaded (``memory_plan.choose_npu_experts``),
    decided before the model loads: the bundle's other bytes, one sequence at the context
    limit the engine will use, the machine's memory (``meminfo``: None reads it). On auto,
    a machine without librknnrt keeps the CPU experts (with the reason): off a board the
    stand-in computes what the NPU would, slower than QMoE, so it runs only when asked."""
    from ling3_rknn.config import ModelConfig
    from ling3_rknn.model.state import StateLayout

    force = npu_experts_setting(options)
    cfg = ModelConfig.from_dict(bundle.manifest.model_config)
    max_context = engine_options(options, cfg.max_position_embeddings).max_context
    choice = choose_npu_experts(
        copy_bytes=bundle.manifest.npu_matmul_expert_bytes(),
        model_bytes=bundle.loaded_bytes(npu_graphs=False),
        sequence_bytes=StateLayout.from_config(cfg, latent_dtype).nbytes(max_context),
        meminfo=machine_memory() if meminfo is None else meminfo, force=force)
    if choice.taken and force is None:
        from ling3_rknn.npu.matmul import resolve_library
        from ling3_rknn.npu.matmul_plan import MatmulError

        try:
            name, _ = resolve_library()
        except MatmulError as exc:
            return replace(choice, taken=False, reason=f"no NPU matmul library: {exc}")
        if name != "librknnrt":  # as --npu-prefill auto: the host stand-in is for tests
            return replace(choice, taken=False, reason="not a board (no librknnrt; the host "
                           "stand-in runs with --npu-experts on)")
    return choice


def _model_bytes(model: Model) -> int:
    """What the model occupies: the bundle files it reads (the routed experts may be
    mapped and not yet read; an rk3588 bundle's ONNX twins stay on disk on a board), else
    the process's resident memory now (an HF checkpoint's numpy model; this counts the
    Python runtime too, which ``RUNTIME_RESERVE`` also covers: an overestimate)."""
    if model.bundle is not None:
        return model.bundle.loaded_bytes(
            npu_graphs=model.npu_graphs,
            npu_matmul_experts=model.npu_matmul_experts is not None)
    status = read_meminfo(Path("/proc/self/status")) or {}
    return status.get("VmRSS", 0)


def _eos_ids(generation_config: dict[str, Any]) -> list[int]:
    """``eos_token_id`` of a generation config: one id, a list of ids, or absent."""
    eos = generation_config.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"generation config: eos_token_id must be a token id or a list of "
                         f"them, got {eos!r}")
    return ids


def read_generation_config(path: Path) -> dict[str, Any] | None:
    """An HF ``generation_config.json`` if the checkpoint has one (it is optional)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path.name}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: expected a JSON object")
    return data


def engine_from_hf(hf_dir: Path, tokenizer_path: Path, options: LoadOptions, *,
                   latent_dtype: str = "float32") -> Engine:
    """The numpy model on an HF checkpoint (no bundle, no NPU). ``latent_dtype``: the MLA
    latent cache's dtype (``--latent-cache``)."""
    from ling3_rknn.model import Model
    from ling3_rknn.tokenizer import Tokenizer

    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer_path}")
    return make_engine(
        Model.from_hf(hf_dir, latent_dtype=latent_dtype),
        Tokenizer.from_file(tokenizer_path),
        options,
        generation_config=read_generation_config(hf_dir / "generation_config.json"),
    )


def engine_from_bundle(bundle_dir: Path, options: LoadOptions, *,
                       default_model_id: str = DEFAULT_MODEL_ID,
                       verify: str = "stamped", latent_dtype: str = "float32") -> Engine:
    """A converted bundle: RKNNLite on a board, the RKNNLite mock (ONNX twins) on a host.
    ``verify`` is ``Bundle.verify``'s mode; ``size`` is the explicit opt-out of hashing.
    ``latent_dtype``: the MLA latent cache's dtype (``--latent-cache``)."""
    from ling3_rknn.bundle import Bundle
    from ling3_rknn.chat import TEMPLATE_SHA256

    # Typed errors for a missing/incomplete/corrupt bundle first (before the model package
    # loads); a template other than the one the renderer implements is a loud warning.
    bundle = Bundle.open(bundle_dir, verify=verify,  # type: ignore[arg-type]
                         expected_template_sha256=TEMPLATE_SHA256)
    from ling3_rknn.model import Model
    from ling3_rknn.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(bundle.path(bundle.manifest.tokenizer))
    # The manifest holds the sha256 of every file, so its own hash names the weights.
    identity = hashlib.sha256((bundle.root / "manifest.json").read_bytes()).hexdigest()
    npu_experts = npu_experts_choice(bundle, options, latent_dtype)
    log.info("%s", npu_experts.describe())
    return make_engine(
        # opened and verified just above
        Model.from_bundle(bundle, verify="none", latent_dtype=latent_dtype,
                          npu_prefill=options.npu_prefill,  # type: ignore[arg-type]
                          npu_experts=npu_experts.taken),
        tokenizer,
        options,
        generation_config=bundle.manifest.generation_config,
        weights_identity=f"bundle:{identity}",
        default_model_id=default_model_id,
        npu_experts=npu_experts,
    )

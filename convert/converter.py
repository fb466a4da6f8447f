"""HF checkpoint -> bundle: the ``ling3-rknn convert`` pipeline.

Order of work, chosen for memory: (1) calibration runs the float32 numpy model on the
prompts (dense weights only; experts are read per routed token); (2) the stage graphs are
built, written and (for rk3588) compiled one stage at a time from that layer's tensors;
(3) routed experts are quantized one expert at a time into each MoE layer's packed file
(and, for the NPU's prefill matmuls, its int8 copy); (4) the CPU weights file; (5) the
manifest, written last by the atomic ``BundleWriter``.
Peak RAM is the float32 dense weights plus one MoE layer of packed experts, well under
the bf16 checkpoint.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convert.bundle_files import (
    expert_block,
    write_cpu_weights,
    write_experts,
    write_npu_experts,
)
from convert.calibration import CalibrationData, calibrate, load_prompts
from convert.options import ConvertError, ConvertOptions, check_options, stage_quant
from convert.placement import PlacementReport, default_npu_budget, plan_placement
from convert.stage_graphs import expert_graph, stage_names
from convert.stage_writer import StageWriter, build_stage
from ling3_rknn.bundle import (
    FORMAT_VERSION,
    QMOE_FORMATS,
    WEIGHTS_FILE,
    BundleWriter,
    ExpertsSpec,
    Manifest,
    NpuMatmulExpertsSpec,
    PlacementPlan,
    StageName,
    StageSpec,
    sha256_file,
)
from ling3_rknn.config import ModelConfig
from ling3_rknn.model import Checkpoint, CheckpointError
from ling3_rknn.model.weights import CheckpointWeights

log = logging.getLogger(__name__)


@dataclass
class ConvertReport:
    bundle: Path
    seconds: float
    stage_bytes: dict[str, int] = field(default_factory=dict)
    placement: PlacementReport | None = None
    calibration_tokens: int = 0


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False)


# --------------------------------------------------------------------------- orchestration
def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{what} {path.name}: {exc}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{what} {path.name} is not a JSON object")
    return data


def _chat_template(hf: Path, explicit: Path | None) -> str | None:
    if explicit is not None:
        try:
            return explicit.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConvertError(f"--chat-template: {exc}") from None
    if (hf / "chat_template.jinja").is_file():
        return (hf / "chat_template.jinja").read_text(encoding="utf-8")
    if (hf / "tokenizer_config.json").is_file():
        template = _read_json(hf / "tokenizer_config.json", "tokenizer config").get(
            "chat_template")
        if isinstance(template, str):
            return template
    log.warning("no chat template found next to the checkpoint; the bundle carries none")
    return None


def open_checkpoint(hf_dir: str | os.PathLike[str]) -> CheckpointWeights:
    """Config + safetensors with typed errors (ConfigError / CheckpointError)."""
    hf = Path(hf_dir)
    if not hf.is_dir():
        raise ConvertError(f"checkpoint directory {str(hf)!r} does not exist")
    cfg = ModelConfig.from_file(hf / "config.json")
    return CheckpointWeights(Checkpoint.open(hf), cfg)


def check_checkpoint(w: CheckpointWeights) -> None:
    """Every tensor the bundle needs is present with the right shape, before any work."""
    cfg = w.cfg
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            w.check_experts(i)
    # the dense accessors check names and shapes as they read; reading is lazy for
    # memory-mapped float32 and one layer at a time for bf16.
    for name in stage_names(cfg):
        _build_stage_weights_only(w, name)


def _build_stage_weights_only(w: CheckpointWeights, name: str) -> None:
    cfg = w.cfg
    stage = StageName.parse(name)
    if stage.layer is None:
        w.final()
        return
    i = stage.layer
    if stage.role == "in":
        w.kda_input(i) if cfg.layer_kinds[i] == "kda" else w.mla_input(i)
    else:
        w.output(i)


def convert(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
            opts: ConvertOptions | None = None,
            on_stage: Callable[[str], None] | None = None) -> ConvertReport:
    """Convert ``hf_dir`` into a bundle at ``out_dir``; see the module docstring."""
    opts = opts if opts is not None else ConvertOptions()
    check_options(opts)
    start = time.perf_counter()
    hf = Path(hf_dir)
    w = open_checkpoint(hf)
    cfg = w.cfg
    tok_path = opts.tokenizer or hf / "tokenizer.json"
    if not tok_path.is_file():
        raise ConvertError(f"no tokenizer: {str(tok_path)!r} does not exist (pass --tokenizer)")
    block = expert_block(cfg, opts.block_size) if opts.experts != "fp16" else 0
    check_checkpoint(w)
    template = _chat_template(hf, opts.chat_template)
    gen_path = hf / "generation_config.json"
    generation = _read_json(gen_path, "generation config") if gen_path.is_file() else {}

    calib = None
    report = ConvertReport(Path(out_dir), 0.0)
    if opts.target == "rk3588":
        from ling3_rknn.tokenizer import Tokenizer

        tok = Tokenizer.from_file(tok_path)
        prompts = load_prompts(opts.calibration, tok.encode_text)
        with _progress(len(prompts), "calibration", opts.progress) as bar:
            calib = calibrate(w, prompts, opts.chunk, opts.calibration_samples, bar.update)
        report.calibration_tokens = calib.tokens

    names = stage_names(cfg)
    wdtype = np.float32
    with BundleWriter(out_dir, overwrite=opts.overwrite, resume=opts.resume) as writer:
        stages: dict[str, StageSpec] = {}
        sw = StageWriter(writer, opts, calib)
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        npu_layers = moe_layers if opts.writes_npu_experts else []
        total = len(names) + len(moe_layers) + len(npu_layers) + 1
        with _progress(total, "convert", opts.progress) as bar:
            for name in names:
                stages[name] = sw.write(name, functools.partial(build_stage, w, name, wdtype))
                report.stage_bytes[name] = stages[name].nbytes
                if on_stage is not None:
                    on_stage(name)
                bar.update(1)
            plan = PlacementPlan(stage_cores={n: "auto" for n in names})
            if calib is not None:
                report.placement = _place(calib, cfg, opts, report.stage_bytes, names)
                plan = report.placement.plan
                for layer, ids in plan.npu_experts.items():
                    for e in ids:
                        gate_up, down = w.expert(layer, e)
                        name = str(StageName.npu_expert(layer, e))
                        stages[name] = sw.write(name, functools.partial(
                            expert_graph, name, gate_up, down, cfg, wdtype))
                        report.stage_bytes[name] = stages[name].nbytes
            experts_layers = {}
            for layer in moe_layers:
                experts_layers[layer] = write_experts(writer, w, layer, opts.experts, block)
                bar.update(1)
            npu_matmul = {}
            for layer in npu_layers:
                npu_matmul[layer] = write_npu_experts(writer, w, layer)
                bar.update(1)
            write_cpu_weights(writer, w)
            bar.update(1)
        tok_rel = "tokenizer.json"
        if not writer.done(tok_rel):
            writer.copy_file(tok_rel, tok_path)
        tmpl_rel = None
        if template is not None:
            tmpl_rel = "chat_template.jinja"
            if not writer.done(tmpl_rel):
                writer.write_bytes(tmpl_rel, template.encode("utf-8"))
        writer.path("build").rmdir() if writer.path("build").is_dir() else None
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            created_by="ling3-rknn convert" + ("" if opts.build_rknn or opts.target == "cpu"
                                               else " (placeholder .rknn: host mock only)"),
            target=opts.target,
            model_config=cfg.to_dict(),
            generation_config=generation,
            chunk_sizes=opts.chunk_sizes,
            tokenizer=tok_rel,
            tokenizer_sha256=_sha(writer, tok_rel),
            chat_template=tmpl_rel,
            chat_template_sha256=None if tmpl_rel is None else _sha(writer, tmpl_rel),
            weights=WEIGHTS_FILE,
            stages=stages,
            experts=ExpertsSpec(format=opts.experts, block_size=block or 1,
                                top_k=cfg.num_experts_per_tok, layers=experts_layers),
            placement=plan,
            files={},  # BundleWriter.commit hashes every file
            npu_matmul_experts=(NpuMatmulExpertsSpec("int8", npu_matmul) if npu_matmul
                                else None),
        )
        writer.commit(manifest)
    report.seconds = time.perf_counter() - start
    return report


def _sha(writer: BundleWriter, rel: str) -> str:
    return sha256_file(writer.path(rel))


def _place(calib: CalibrationData, cfg: ModelConfig, opts: ConvertOptions,
           stage_bytes: dict[str, int], names: list[str]) -> PlacementReport:
    per_weight = 2 if stage_quant(opts) == "fp16" else 1
    expert_bytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * per_weight
    dense = sum(stage_bytes.values())
    budget = opts.npu_budget
    if budget is None and opts.experts in QMOE_FORMATS:
        # QMoE's k is a graph attribute: a token whose selection is partly on the NPU still
        # runs k experts on the CPU (the NPU ones at weight 0), so promoted experts cost NPU
        # calls and save no CPU time. Per-k sessions (a prepacked weight copy each) and the
        # weights as graph inputs (10x slower per call) were measured (convert/README.md).
        log.info("no routed experts on the NPU by default with %s experts (QMoE runs k "
                 "experts per token either way); pass --npu-budget to place some", opts.experts)
        budget = 0
    elif budget is None:
        budget = default_npu_budget(dense)
    return plan_placement(calib.route_counts, calib.moe_layers, calib.tokens,
                          cfg.num_experts_per_tok, expert_bytes, budget, len(names), names,
                          max_calls_per_token=opts.max_calls_per_token)


__all__ = ["CheckpointError", "ConvertError", "ConvertOptions", "ConvertReport", "build_stage",
           "convert"]

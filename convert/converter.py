"""HF checkpoint -> bundle: the ``ling3-rknn convert`` pipeline.

Order of work, chosen for memory: (1) calibration runs the float32 numpy model on the
prompts (dense weights only; experts are read per routed token); (2) the stage graphs are
built, written and (for rk3588) compiled one stage at a time from that layer's tensors;
(3) routed experts are quantized one expert at a time into each MoE layer's packed file;
(4) the CPU weights file; (5) the manifest, written last by the atomic ``BundleWriter``.
Peak RAM is the float32 dense weights plus one MoE layer of packed experts, well under
the bf16 checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from safetensors.numpy import save_file

from convert.calibration import CalibrationData, calibrate, load_prompts
from convert.experts_quant import pack_experts
from convert.placement import PlacementReport, default_npu_budget, plan_placement
from convert.qmoe_graph import write_qmoe_layer
from convert.stage_graphs import (
    StageGraph,
    expert_graph,
    final_graph,
    kda_input_graph,
    kda_output_graph,
    mla_input_graph,
    mla_output_graph,
    stage_names,
)
from ling3_rknn.bundle import PLACEHOLDER_MAGIC, BundleWriter, PlacementPlan
from ling3_rknn.config import ModelConfig
from ling3_rknn.model import Checkpoint, CheckpointError
from ling3_rknn.model.weights import CheckpointWeights
from ling3_rknn.npu.experts import PackedExperts

log = logging.getLogger(__name__)
QMOE_FORMATS = ("int4", "int8")  # expert formats run by onnxruntime's QMoE kernel

WEIGHTS_FILE = "weights.safetensors"


W8A8_ALGORITHMS = ("normal", "mmse", "kl_divergence")
# Stage weight formats per target; the first is the default.
STAGE_QUANTS = {"rk3588": ("fp16", "w8a8"), "cpu": ("int8", "int4", "fp32")}
# --target cpu int8/int4: onnxruntime's MatMulNBits, symmetric, this block, activations
# quantized to int8 inside the kernel (accuracy_level 4: the integer dot-product kernels).
CPU_QUANT_BLOCK = 32
CPU_QUANT_ACCURACY_LEVEL = 4


def stage_quant(o: ConvertOptions) -> str:
    """The stage weight format the options ask for (``--quant`` or the target's default)."""
    return o.quant if o.quant is not None else STAGE_QUANTS[o.target][0]


class ConvertError(ValueError):
    """The conversion cannot proceed: bad options or inputs that are not a checkpoint."""


@dataclass(frozen=True)
class ConvertOptions:
    target: str = "rk3588"  # rk3588 | cpu
    # stage weights. rk3588: fp16 | w8a8; cpu: int8 | int4 (onnxruntime MatMulNBits) | fp32.
    # None: the target's default (fp16 for the NPU, int8 for the CPU).
    quant: str | None = None
    experts: str = "int4"  # int4 | int8 | fp16
    calibration: Path | None = None
    # bytes for NPU experts; None: what the window leaves for fp16 experts, 0 for QMoE ones
    npu_budget: int | None = None
    chunk: int = 64
    tokenizer: Path | None = None
    chat_template: Path | None = None
    block_size: int = 32
    calibration_samples: int = 8
    # w8a8 only: rknn-toolkit2's calibration algorithm (normal | mmse | kl_divergence) and
    # the auto-hybrid cosine threshold (ops whose calibration cosine falls below it stay
    # fp16; None: all int8). Recorded per stage in the manifest.
    w8a8_algorithm: str = "normal"
    w8a8_hybrid_cos: float | None = None
    build_rknn: bool = True  # False: placeholder .rknn files (host tests only)
    overwrite: bool = False
    resume: bool = False
    progress: bool = True
    max_calls_per_token: float = 60.0


@dataclass
class ConvertReport:
    bundle: Path
    seconds: float
    stage_bytes: dict[str, int] = field(default_factory=dict)
    placement: PlacementReport | None = None
    calibration_tokens: int = 0


def _check_options(o: ConvertOptions) -> None:
    if o.target not in ("rk3588", "cpu"):
        raise ConvertError(f"--target must be rk3588 or cpu, not {o.target!r}")
    allowed = STAGE_QUANTS[o.target]
    if o.quant is not None and o.quant not in allowed:
        raise ConvertError(f"--quant for --target {o.target} must be one of "
                           f"{', '.join(allowed)}, not {o.quant!r}")
    if o.experts not in ("int4", "int8", "fp16"):
        raise ConvertError(f"--experts must be int4, int8 or fp16, not {o.experts!r}")
    if o.w8a8_algorithm not in W8A8_ALGORITHMS:
        raise ConvertError(f"w8a8 algorithm must be one of {W8A8_ALGORITHMS}, "
                           f"not {o.w8a8_algorithm!r}")
    if o.w8a8_hybrid_cos is not None and not 0.0 < o.w8a8_hybrid_cos < 1.0:
        raise ConvertError(f"w8a8 hybrid cosine threshold must be in (0, 1), "
                           f"got {o.w8a8_hybrid_cos}")
    if o.chunk < 2:
        raise ConvertError(f"--chunk must be at least 2, got {o.chunk}")
    if o.npu_budget is not None and o.npu_budget < 0:
        raise ConvertError("--npu-budget must not be negative")


def _expert_block(cfg: ModelConfig, wanted: int) -> int:
    """Largest power-of-two block <= ``wanted`` (and >= 16) dividing D and I."""
    block = wanted
    while block >= 16:
        if cfg.hidden_size % block == 0 and cfg.moe_intermediate_size % block == 0:
            return block
        block //= 2
    raise ConvertError(f"hidden {cfg.hidden_size} / expert width {cfg.moe_intermediate_size} "
                       "have no common power-of-two block >= 16 for QMoE; use --experts fp16")


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False)


# --------------------------------------------------------------------------- stages
def _build_stage(w: CheckpointWeights, name: str, wdtype: type,
                 external: Path | None = None) -> StageGraph:
    cfg = w.cfg
    if name == "final":
        return final_graph(name, w.final(), cfg, wdtype, external)
    _, idx, role = name.split(".")
    i = int(idx)
    kda = cfg.layer_kinds[i] == "kda"
    if role == "in":
        return (kda_input_graph(name, w.kda_input(i), cfg, wdtype, external) if kda
                else mla_input_graph(name, w.mla_input(i), cfg, wdtype, external))
    out = w.output(i)
    return (kda_output_graph(name, out, cfg, wdtype, external) if kda
            else mla_output_graph(name, out, cfg, wdtype, external))


def _weight_count(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT)


GraphFactory = Callable[[Path | None], StageGraph]


class _StageWriter:
    """Writes one stage: the ONNX twin (QDQ for w8a8) and, for rk3588, its ``.rknn``.

    Large weights go to ``<stage>.onnx.data`` as the graph is built (GraphBuilder's
    external data), so peak memory stays near one copy of the largest weight.
    """

    def __init__(self, writer: BundleWriter, opts: ConvertOptions,
                 calib: CalibrationData | None) -> None:
        self.writer, self.opts, self.calib = writer, opts, calib
        self.quant = stage_quant(opts)
        # stages whose twin is derived from an fp32 source graph built aside
        self.derived = self.quant in ("w8a8", "int8", "int4")

    def write(self, name: str, build: GraphFactory) -> dict[str, Any]:
        o, rel = self.opts, f"stages/{name}"
        onnx_rel, rknn_rel = rel + ".onnx", (None if o.target == "cpu" else rel + ".rknn")
        done = self.writer.done(onnx_rel) and (rknn_rel is None or self.writer.done(rknn_rel))
        # the twin of a w8a8 stage is derived; the fp32 source graph is built aside
        src_dir = "build" if (self.derived or done) else "stages"
        src = self.writer.path(f"{src_dir}/{name}.onnx")
        data = src.with_name(src.name + ".data")
        data.unlink(missing_ok=True)
        graph = build(data)
        chunk_sets = graph.shape_sets((o.chunk,))
        per_weight = {"fp32": 4, "fp16": 2, "w8a8": 1, "int8": 1.125, "int4": 0.625}[
            self.quant]
        spec = {"onnx": onnx_rel, "rknn": rknn_rel, "quant": self.quant,
                "inputs": list(graph.inputs), "outputs": list(graph.outputs),
                "shape_sets": [[list(s) for s in group] for group in chunk_sets],
                "input_dtype": "float32",
                "nbytes": int(_weight_count(graph.model) * per_weight)}
        if self.quant in ("int8", "int4"):
            spec["quantization"] = {"op": "MatMulNBits", "block_size": CPU_QUANT_BLOCK,
                                    "accuracy_level": CPU_QUANT_ACCURACY_LEVEL}
        if self.quant == "w8a8":
            spec["quantization"] = {"algorithm": o.w8a8_algorithm,
                                    "hybrid_cos": o.w8a8_hybrid_cos,
                                    "calibration_samples": o.calibration_samples}
        try:
            if not done:
                onnx.save(graph.model, str(src))
                onnx.checker.check_model(str(src))
                self._write_rknn(graph, src, rknn_rel, chunk_sets, name)
                self._write_twin(graph, src, onnx_rel, name)
        finally:
            if src_dir == "build":
                src.unlink(missing_ok=True)
                data.unlink(missing_ok=True)
        if rknn_rel is not None and o.build_rknn:
            spec["nbytes"] = self.writer.path(rknn_rel).stat().st_size
        return spec

    def _samples(self, name: str, inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        if self.calib is None:
            raise ConvertError("w8a8 needs calibration samples")
        parts, count = name.split("."), self.opts.calibration_samples
        if len(parts) == 4 and parts[2] == "expert":
            return self.calib.expert_samples(int(parts[1]), int(parts[3]), count)
        return self.calib.samples(name, inputs, count)

    def _write_rknn(self, graph: StageGraph, src: Path, rknn_rel: str | None,
                    shape_sets: Any, name: str) -> None:
        if rknn_rel is None:
            return
        path = self.writer.path(rknn_rel)
        if not self.opts.build_rknn:
            digest = hashlib.sha256(graph.model.SerializeToString()).hexdigest()
            path.write_bytes(PLACEHOLDER_MAGIC + f"{name} {self.quant} onnx-sha256 "
                             f"{digest}\n".encode())
            self.writer.record(rknn_rel)
            return
        from convert.rknn_toolkit import build_rknn

        result = build_rknn(src, path, self.quant,
                            calibration=(self._samples(name, graph.inputs)
                                         if self.quant == "w8a8" else None),
                            dynamic_input=shape_sets, algorithm=self.opts.w8a8_algorithm,
                            hybrid_cos=(self.opts.w8a8_hybrid_cos
                                        if self.quant == "w8a8" else None))
        if result.cpu_ops:
            log.warning("%s: ops left on the board CPU: %s", name, ", ".join(result.cpu_ops))
        self.writer.record(rknn_rel)

    def _write_twin(self, graph: StageGraph, src: Path, onnx_rel: str, name: str) -> None:
        # fp16/fp32: the twin is the very graph the .rknn was compiled from (README: the
        # mocked NPU).
        # w8a8: the same graph with the int8 quantization simulated, so host runs show
        # its error.
        if self.quant == "w8a8":
            from convert.w8a8_twin import quantize_twin

            model = quantize_twin(src, self._samples(name, graph.inputs))
            self.writer.write_bytes(onnx_rel, model.SerializeToString())
            return
        if self.quant in ("int8", "int4"):
            from convert.cpu_quant import quantize_matmuls

            model = quantize_matmuls(src, bits=8 if self.quant == "int8" else 4,
                                     block_size=CPU_QUANT_BLOCK,
                                     accuracy_level=CPU_QUANT_ACCURACY_LEVEL)
            self.writer.write_bytes(onnx_rel, model.SerializeToString())
            return
        data = src.with_name(src.name + ".data")
        if data.is_file():
            self.writer.record(onnx_rel + ".data")
        self.writer.record(onnx_rel)


# --------------------------------------------------------------------------- experts
def _pack_layer(w: CheckpointWeights, layer: int, bits: int, block: int) -> PackedExperts:
    """One expert at a time, so a bf16 layer is never widened whole."""
    cfg = w.cfg
    i = cfg.moe_intermediate_size

    def load(x: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        gate_up, down = w.expert(layer, x)
        return gate_up[:i], gate_up[i:], down

    return pack_experts(cfg.num_experts, i, cfg.hidden_size, load, bits, block)


def _write_experts(writer: BundleWriter, w: CheckpointWeights, layer: int, fmt: str,
                   block: int) -> dict[str, str]:
    cfg = w.cfg
    rel = f"experts/layer_{layer:02d}"
    entry = {"weights": rel + ".safetensors"}
    if fmt == "fp16":
        if not writer.done(entry["weights"]):
            i = cfg.moe_intermediate_size
            gate = np.empty((cfg.num_experts, i, cfg.hidden_size), np.float16)
            up = np.empty_like(gate)
            down = np.empty((cfg.num_experts, cfg.hidden_size, i), np.float16)
            for x in range(cfg.num_experts):
                gate_up, dn = w.expert(layer, x)
                gate[x], up[x], down[x] = gate_up[:i], gate_up[i:], dn
            save_file({"gate": gate, "up": up, "down": down}, writer.path(entry["weights"]))
            writer.record(entry["weights"])
        return entry
    entry["onnx"] = rel + ".onnx"
    if writer.done(entry["weights"]) and writer.done(entry["onnx"]):
        return entry
    packed = _pack_layer(w, layer, 4 if fmt == "int4" else 8, block)
    save_file(packed.tensors(), writer.path(entry["weights"]))
    writer.record(entry["weights"])
    write_qmoe_layer(packed, writer.path(entry["weights"]), writer.path(entry["onnx"]),
                     cfg.num_experts_per_tok)
    writer.record(entry["onnx"])
    return entry


# --------------------------------------------------------------------------- CPU weights
def _write_cpu_weights(writer: BundleWriter, w: CheckpointWeights) -> None:
    """Embedding table (fp16 when the checkpoint stores 16-bit floats and fp16 holds them,
    else fp32), KDA conv taps [K, 3P] and MoE expert biases, all for the CPU glue."""
    if writer.done(WEIGHTS_FILE):
        return
    cfg = w.cfg
    name = "model.word_embeddings.weight"
    table = w.ckpt.tensor(name, (cfg.vocab_size, cfg.hidden_size))
    f, stored = w.ckpt.locate(name, (cfg.vocab_size, cfg.hidden_size))
    if f.raw(stored).dtype.itemsize == 2:
        half = table.astype(np.float16)
        table = half if np.isfinite(half).all() else table
    tensors = {"embedding": np.ascontiguousarray(table)}
    for i in cfg.kda_layers:
        tensors[f"conv.{i}"] = np.ascontiguousarray(w.kda_conv(i).T, dtype=np.float32)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            tensors[f"expert_bias.{i}"] = np.array(w.expert_bias(i), np.float32)
    save_file(tensors, writer.path(WEIGHTS_FILE))
    writer.record(WEIGHTS_FILE)


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
    if name == "final":
        w.final()
        return
    _, idx, role = name.split(".")
    i = int(idx)
    if role == "in":
        w.kda_input(i) if cfg.layer_kinds[i] == "kda" else w.mla_input(i)
    else:
        w.output(i)


def convert(hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
            opts: ConvertOptions = ConvertOptions(),
            on_stage: Callable[[str], None] | None = None) -> ConvertReport:
    """Convert ``hf_dir`` into a bundle at ``out_dir``; see the module docstring."""
    _check_options(opts)
    start = time.perf_counter()
    hf = Path(hf_dir)
    w = open_checkpoint(hf)
    cfg = w.cfg
    tok_path = opts.tokenizer or hf / "tokenizer.json"
    if not tok_path.is_file():
        raise ConvertError(f"no tokenizer: {str(tok_path)!r} does not exist (pass --tokenizer)")
    block = _expert_block(cfg, opts.block_size) if opts.experts != "fp16" else 0
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
        stages: dict[str, dict[str, Any]] = {}
        sw = _StageWriter(writer, opts, calib)
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        total = len(names) + len(moe_layers) + 1
        with _progress(total, "convert", opts.progress) as bar:
            for name in names:
                stages[name] = sw.write(
                    name, lambda ext, name=name: _build_stage(w, name, wdtype, ext))
                report.stage_bytes[name] = stages[name]["nbytes"]
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
                        name = f"layer.{layer}.expert.{e}"
                        stages[name] = sw.write(
                            name, lambda ext, name=name, gu=gate_up, dn=down:
                            expert_graph(name, gu, dn, cfg, wdtype, ext))
                        report.stage_bytes[name] = stages[name]["nbytes"]
            experts_layers = {}
            for layer in moe_layers:
                experts_layers[str(layer)] = _write_experts(writer, w, layer, opts.experts,
                                                            block)
                bar.update(1)
            _write_cpu_weights(writer, w)
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
        manifest = {
            "created_by": "ling3-rknn convert" + ("" if opts.build_rknn or opts.target == "cpu"
                                                  else " (placeholder .rknn: host mock only)"),
            "target": opts.target,
            "model_config": cfg.to_dict(),
            "generation_config": generation,
            "chunk_sizes": [opts.chunk],
            "tokenizer": {"file": tok_rel, "sha256": _sha(writer, tok_rel)},
            "chat_template": None if tmpl_rel is None else {
                "file": tmpl_rel, "sha256": _sha(writer, tmpl_rel)},
            "weights": WEIGHTS_FILE,
            "stages": stages,
            "experts": {"format": opts.experts, "block_size": block or 1,
                        "top_k": cfg.num_experts_per_tok, "layers": experts_layers},
            "placement": {"stage_cores": dict(plan.stage_cores),
                          "npu_experts": {str(k): list(v) for k, v in plan.npu_experts.items()},
                          "npu_budget_bytes": plan.npu_budget_bytes},
        }
        writer.commit(manifest)
    report.seconds = time.perf_counter() - start
    return report


def _sha(writer: BundleWriter, rel: str) -> str:
    from ling3_rknn.bundle import sha256_file

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


__all__ = ["CheckpointError", "ConvertError", "ConvertOptions", "ConvertReport", "convert"]

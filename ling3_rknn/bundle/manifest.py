"""The typed manifest: what a bundle holds, as the runtime reads it and the converter
writes it. :meth:`Manifest.from_json` is the one schema check (``format``, version, keys,
types, enums, relative paths, the files table); :meth:`Manifest.to_json` its inverse.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatVersionError, ManifestError
from .format import (
    CORE_MASK_NAMES,
    EXPERT_FORMATS,
    FORMAT,
    NPU_MATMUL_EXPERT_FORMATS,
    NPU_QUANT_TYPES,
    QUANT_TYPES,
    READABLE_FORMAT_VERSIONS,
    TARGETS,
)
from .json_reader import JsonReader, check_relpath, shape_sets_of


@dataclass(frozen=True)
class FileEntry:
    """A file the bundle holds: checked against these on every open."""

    size: int
    sha256: str


@dataclass(frozen=True)
class StageSpec:
    """One NPU graph. ``shape_sets`` lists every static shape combination the graph
    accepts, in rknn-toolkit2's ``dynamic_input`` layout: ``[[shape of input 0, shape of
    input 1, ...], ...]`` (e.g. one set for decode T=1 and one for a prefill chunk)."""

    name: str
    onnx: str
    rknn: str | None
    quant: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shape_sets: tuple[tuple[tuple[int, ...], ...], ...]
    input_dtype: str = "float32"
    nbytes: int = 0  # NPU-resident bytes (size of the .rknn), for the memory budget
    # how the converter quantized it (w8a8: toolkit algorithm, auto-hybrid threshold);
    # provenance for re-tuning, not read by the runtime
    quantization: dict[str, str | float | None] | None = None


@dataclass(frozen=True)
class ExpertsSpec:
    """Routed experts on the CPU: one safetensors file (+ QMoE graph) per MoE layer."""

    format: str
    block_size: int
    top_k: int
    layers: dict[int, dict[str, str]]  # layer index -> {"weights": ..., "onnx": ...}


@dataclass(frozen=True)
class NpuMatmulExpertsSpec:
    """The routed experts' int8 copy for prefill on the NPU (format version 3): one
    safetensors file per MoE layer, beside the CPU copy of ``ExpertsSpec``. The runtime
    loads it only where the memory plan allows (``ling3_rknn.memory_plan``)."""

    format: str
    layers: dict[int, str]  # layer index -> relative path of its .npu.safetensors


@dataclass(frozen=True)
class PlacementPlan:
    """Where work runs; data, so it can be re-tuned from board measurements."""

    stage_cores: dict[str, str] = field(default_factory=dict)  # stage -> core mask name
    npu_experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> ids
    npu_budget_bytes: int | None = None


@dataclass(frozen=True)
class Manifest:
    format_version: int
    target: str
    model_config: dict[str, Any]
    generation_config: dict[str, Any]
    chunk_sizes: tuple[int, ...]
    tokenizer: str
    tokenizer_sha256: str
    chat_template: str | None
    chat_template_sha256: str | None
    weights: str
    stages: dict[str, StageSpec]
    experts: ExpertsSpec | None
    placement: PlacementPlan
    files: dict[str, FileEntry]
    created_by: str = ""
    npu_matmul_experts: NpuMatmulExpertsSpec | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "created_by": self.created_by,
            "target": self.target,
            "model_config": self.model_config,
            "generation_config": self.generation_config,
            "chunk_sizes": list(self.chunk_sizes),
            "tokenizer": {"file": self.tokenizer, "sha256": self.tokenizer_sha256},
            "chat_template": (None if self.chat_template is None else
                              {"file": self.chat_template, "sha256": self.chat_template_sha256}),
            "weights": self.weights,
            "stages": {
                name: {"onnx": s.onnx, "rknn": s.rknn, "quant": s.quant,
                       "inputs": list(s.inputs), "outputs": list(s.outputs),
                       "shape_sets": [[list(shape) for shape in group] for group in s.shape_sets],
                       "input_dtype": s.input_dtype, "nbytes": s.nbytes,
                       **({} if s.quantization is None else {"quantization": s.quantization})}
                for name, s in self.stages.items()
            },
            "experts": None if self.experts is None else {
                "format": self.experts.format, "block_size": self.experts.block_size,
                "top_k": self.experts.top_k,
                "layers": {str(k): dict(v) for k, v in sorted(self.experts.layers.items())},
            },
            **({} if self.npu_matmul_experts is None else {"npu_matmul_experts": {
                "format": self.npu_matmul_experts.format,
                "layers": {str(k): v for k, v in sorted(self.npu_matmul_experts.layers.items())},
            }}),
            "placement": {
                "stage_cores": dict(self.placement.stage_cores),
                "npu_experts": {str(k): list(v) for k, v in
                                sorted(self.placement.npu_experts.items())},
                "npu_budget_bytes": self.placement.npu_budget_bytes,
            },
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in
                      sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        return _parse_manifest(data)

    def referenced_files(self) -> Iterator[tuple[str, str]]:
        """(manifest key, relative path) of every file the manifest points at."""
        yield "tokenizer.file", self.tokenizer
        if self.chat_template is not None:
            yield "chat_template.file", self.chat_template
        yield "weights", self.weights
        for name, s in self.stages.items():
            yield f"stages.{name}.onnx", s.onnx
            if s.rknn is not None:
                yield f"stages.{name}.rknn", s.rknn
        if self.experts is not None:
            for layer, entry in self.experts.layers.items():
                for role, rel in entry.items():
                    yield f"experts.layers.{layer}.{role}", rel
        if self.npu_matmul_experts is not None:
            for layer, rel in self.npu_matmul_experts.layers.items():
                yield f"npu_matmul_experts.layers.{layer}", rel

    def npu_matmul_expert_bytes(self) -> int:
        """Bytes of the int8 copy's files (0 without one): what taking it costs in memory."""
        spec = self.npu_matmul_experts
        return 0 if spec is None else sum(self.files[rel].size for rel in spec.layers.values())


def _parse_manifest(data: object) -> Manifest:
    root = JsonReader(data, "")
    fmt = root.get("format", str)
    if fmt != FORMAT:
        raise ManifestError("format", f"{fmt!r} is not a {FORMAT}")
    version = root.data.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        raise FormatVersionError(version)
    keys = ["format", "format_version", "created_by", "target", "model_config",
            "generation_config", "chunk_sizes", "tokenizer", "chat_template", "weights",
            "stages", "experts", "placement", "files"]
    root.only(*keys, *(["npu_matmul_experts"] if version >= 3 else []))

    files: dict[str, FileEntry] = {}
    files_r = root.obj("files")
    for rel in files_r.data:
        check_relpath(rel, f"files.{rel}")
        entry = files_r.obj(rel)
        entry.only("size", "sha256")
        files[rel] = FileEntry(entry.int_("size"), entry.sha256("sha256"))

    chunks = root.get("chunk_sizes", list)
    if not chunks or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                             for c in chunks):
        raise ManifestError("chunk_sizes", "expected a non-empty list of positive integers")

    tok = root.obj("tokenizer")
    tok.only("file", "sha256")
    tmpl = root.obj("chat_template", optional=True)
    if tmpl is not None:
        tmpl.only("file", "sha256")

    stages: dict[str, StageSpec] = {}
    stages_r = root.obj("stages")
    for name in stages_r.data:
        s = stages_r.obj(name)
        s.only("onnx", "rknn", "quant", "inputs", "outputs", "shape_sets", "input_dtype",
               "nbytes", "quantization")
        quantization = s.data.get("quantization")
        if quantization is not None and not (
                isinstance(quantization, dict) and all(
                    isinstance(k, str) and (v is None or isinstance(v, (str, float, int)))
                    and not isinstance(v, bool) for k, v in quantization.items())):
            raise ManifestError(f"stages.{name}.quantization",
                                "expected an object of strings / numbers")
        inputs = s.get("inputs", list)
        outputs = s.get("outputs", list)
        for key, names in (("inputs", inputs), ("outputs", outputs)):
            if not names or not all(isinstance(n, str) and n for n in names) \
                    or len(set(names)) != len(names):
                raise ManifestError(f"stages.{name}.{key}", "expected unique non-empty names")
        rknn = None if s.data.get("rknn") is None else s.relpath("rknn")
        quant = s.choice("quant", QUANT_TYPES if rknn is None else NPU_QUANT_TYPES)
        stages[name] = StageSpec(
            name=name, onnx=s.relpath("onnx"), rknn=rknn, quant=quant,
            inputs=tuple(inputs), outputs=tuple(outputs),
            shape_sets=shape_sets_of(s.get("shape_sets", list), f"stages.{name}.shape_sets",
                                   len(inputs)),
            input_dtype=s.choice("input_dtype", ("float32", "float16")),
            nbytes=s.int_("nbytes"), quantization=quantization,
        )

    experts = None
    ex = root.obj("experts", optional=True)
    if ex is not None:
        ex.only("format", "block_size", "top_k", "layers")
        layers: dict[int, dict[str, str]] = {}
        layers_r = ex.obj("layers")
        for key in layers_r.data:
            if not key.isdigit():
                raise ManifestError(f"experts.layers.{key}", "layer keys are layer indices")
            entry = layers_r.obj(key)
            layers[int(key)] = {role: entry.relpath(role) for role in entry.data}
        experts = ExpertsSpec(ex.choice("format", EXPERT_FORMATS), ex.int_("block_size", 1),
                              ex.int_("top_k", 1), layers)

    npu_matmul = _npu_matmul_experts(root.obj("npu_matmul_experts", optional=True))

    pl = root.obj("placement")
    pl.only("stage_cores", "npu_experts", "npu_budget_bytes")
    cores_r = pl.obj("stage_cores")
    stage_cores = {name: cores_r.choice(name, CORE_MASK_NAMES) for name in cores_r.data}
    for name in stage_cores:
        if name not in stages:
            raise ManifestError(f"placement.stage_cores.{name}", "no such stage")
    npu_experts: dict[int, tuple[int, ...]] = {}
    ne_r = pl.obj("npu_experts")
    for key, ids in ne_r.data.items():
        if not key.isdigit() or not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ManifestError(f"placement.npu_experts.{key}",
                                "expected layer index -> list of expert ids")
        npu_experts[int(key)] = tuple(ids)
    budget = pl.get("npu_budget_bytes", int, optional=True)

    if npu_matmul is not None and experts is not None:
        extra = sorted(set(npu_matmul.layers) - set(experts.layers))
        if extra:
            raise ManifestError("npu_matmul_experts.layers",
                                f"layers {extra} have no CPU experts (the copy is a second one)")
    manifest = Manifest(
        format_version=version,
        target=root.choice("target", TARGETS),
        model_config=root.get("model_config", dict),
        generation_config=root.get("generation_config", dict),
        chunk_sizes=tuple(chunks),
        tokenizer=tok.relpath("file"),
        tokenizer_sha256=tok.sha256("sha256"),
        chat_template=None if tmpl is None else tmpl.relpath("file"),
        chat_template_sha256=None if tmpl is None else tmpl.sha256("sha256"),
        weights=root.relpath("weights"),
        stages=stages,
        experts=experts,
        placement=PlacementPlan(stage_cores, npu_experts, budget),
        files=files,
        created_by=root.get("created_by", str, optional=True) or "",
        npu_matmul_experts=npu_matmul,
    )
    for key, rel in manifest.referenced_files():
        if rel not in files:
            raise ManifestError(key, f"{rel!r} is not listed in files")
    if manifest.target == "rk3588":
        for name, spec in stages.items():
            if spec.rknn is None:
                raise ManifestError(f"stages.{name}.rknn", "an rk3588 bundle needs the .rknn")
    if files[manifest.tokenizer].sha256 != manifest.tokenizer_sha256:
        raise ManifestError("tokenizer.sha256", "disagrees with files entry")
    if manifest.chat_template is not None and \
            files[manifest.chat_template].sha256 != manifest.chat_template_sha256:
        raise ManifestError("chat_template.sha256", "disagrees with files entry")
    return manifest


def _npu_matmul_experts(r: JsonReader | None) -> NpuMatmulExpertsSpec | None:
    if r is None:
        return None
    r.only("format", "layers")
    layers_r = r.obj("layers")
    layers: dict[int, str] = {}
    for key in layers_r.data:
        if not key.isdigit():
            raise ManifestError(f"npu_matmul_experts.layers.{key}",
                                "layer keys are layer indices")
        layers[int(key)] = layers_r.relpath(key)
    if not layers:
        raise ManifestError("npu_matmul_experts.layers", "expected at least one layer")
    return NpuMatmulExpertsSpec(r.choice("format", NPU_MATMUL_EXPERT_FORMATS), layers)

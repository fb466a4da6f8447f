"""The converted-model bundle: a directory with ``manifest.json`` and the files it lists.

The manifest is the single source of truth the runtime follows: model config, the NPU
stages (``.rknn`` + ONNX twin, quantization, input/output names, static shape sets), the
routed-expert format, the placement plan (cores per stage, experts promoted to the NPU),
chunk sizes, tokenizer / chat-template hashes and the size + sha256 of every file.

Writing is all-or-nothing: :class:`BundleWriter` fills a hidden temporary directory next
to the target and renames it into place only after ``manifest.json`` - written last -
is complete, so an interrupted conversion never leaves a directory that looks valid.
Loading (:meth:`Bundle.open`) checks the format version and schema and verifies every
file (size only, or full sha256 streamed in chunks); each failure is a typed
:class:`BundleError` naming the file or key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

log = logging.getLogger(__name__)

FORMAT = "ling3-rknn-bundle"
# 2: KDA output stages take ``core_normed`` (the CPU does o_norm's scale-free half)
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
_JOURNAL = ".journal.jsonl"  # resumable conversions only; never part of a bundle
# An NPU graph (a stage with an .rknn) is fp16 or w8a8; fp32 and MatMulNBits int8/int4 exist
# only as ONNX graphs run by onnxruntime (--target cpu).
NPU_QUANT_TYPES = ("fp16", "w8a8")
QUANT_TYPES = ("fp32", *NPU_QUANT_TYPES, "int8", "int4")
EXPERT_FORMATS = ("int4", "int8", "fp16")
TARGETS = ("rk3588", "cpu")
CORE_MASK_NAMES = ("auto", "0", "1", "2", "0_1", "0_1_2", "all")
# full: sha256 of every file; stamped: the same, skipped for files a stamp of an earlier
# full check says are unchanged (size, mtime, inode); size: stat only; none: nothing.
VerifyMode = Literal["full", "stamped", "size", "none"]
_HASH_CHUNK = 1 << 22
STAMP = ".verified.json"  # next to the manifest; never listed in it
_PROGRESS_EVERY_S = 5.0
# The first bytes of the stand-in ``.rknn`` a conversion without rknn-toolkit2 writes
# (``--no-rknn-build``): only the RKNNLite mock, which runs the ONNX twin, may load it.
PLACEHOLDER_MAGIC = b"LING3-RKNN-PLACEHOLDER\n"


# -- errors ---------------------------------------------------------------------------
class BundleError(Exception):
    """Base of every bundle problem."""


class BundleNotFoundError(BundleError):
    pass


class IncompleteBundleError(BundleError):
    """No manifest: not a bundle, or a conversion that never finished."""


class ManifestError(BundleError):
    """manifest.json is not valid JSON or violates the schema; ``key`` names the spot."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"manifest.json: {key}: {message}")
        self.key = key


class FormatVersionError(BundleError):
    def __init__(self, found: object) -> None:
        hint = ("written by a newer ling3-rknn; upgrade the runtime"
                if isinstance(found, int) and found > FORMAT_VERSION
                else "re-convert the checkpoint with this version")
        super().__init__(f"bundle format version {found!r} is not supported "
                         f"(this runtime reads version {FORMAT_VERSION}): {hint}")
        self.found = found


class MissingFileError(BundleError):
    def __init__(self, relpath: str) -> None:
        super().__init__(f"bundle file {relpath!r} listed in the manifest is missing")
        self.relpath = relpath


class FileCorruptError(BundleError):
    """A file's size or sha256 differs from the manifest."""

    def __init__(self, relpath: str, what: str, expected: object, actual: object) -> None:
        super().__init__(f"bundle file {relpath!r}: {what} is {actual}, manifest says {expected}")
        self.relpath = relpath


class BundleExistsError(BundleError):
    pass


class TemplateMismatchWarning(UserWarning):
    """The bundle's chat template is not the one the renderer implements."""


# -- schema ---------------------------------------------------------------------------
@dataclass(frozen=True)
class FileEntry:
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


class _Reader:
    """Typed access into a JSON object that reports the full key path on errors."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, dict):
            raise ManifestError(path or "<root>", f"expected an object, got {type(data).__name__}")
        self.data, self.path = data, path

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise ManifestError(self._key(key), "missing")
        value = self.data[key]
        if value is None and optional:
            return None
        # bool is an int subclass; never accept it where a number is meant
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise ManifestError(self._key(key), f"expected {_names(types)}, got bool")
        if not isinstance(value, types):
            raise ManifestError(self._key(key), f"expected {_names(types)}, "
                                                f"got {type(value).__name__}")
        return value

    def obj(self, key: str, optional: bool = False) -> _Reader | None:
        value = self.get(key, dict, optional)
        return None if value is None else _Reader(value, self._key(key))

    def relpath(self, key: str) -> str:
        return _check_relpath(self.get(key, str), self._key(key))

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.get(key, str)
        if value not in allowed:
            raise ManifestError(self._key(key), f"{value!r} is not one of {allowed}")
        return value

    def sha256(self, key: str) -> str:
        value = self.get(key, str)
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ManifestError(self._key(key), "not a lowercase hex sha256")
        return value

    def int_(self, key: str, minimum: int = 0) -> int:
        value = self.get(key, int)
        if value < minimum:
            raise ManifestError(self._key(key), f"must be >= {minimum}, got {value}")
        return value

    def only(self, *keys: str) -> None:
        extra = sorted(set(self.data) - set(keys))
        if extra:
            raise ManifestError(self.path or "<root>", f"unknown keys {extra}")


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple[type, ...]) -> str:
    return "/".join(t.__name__ for t in _as_tuple(types))


def _check_relpath(value: str, key: str) -> str:
    p = PurePosixPath(value)
    if not value or p.is_absolute() or ".." in p.parts or "\\" in value or value != str(p):
        raise ManifestError(key, f"{value!r} is not a plain relative path inside the bundle")
    return value


def _shape_sets(value: object, key: str, n_inputs: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(group, list) and len(group) == n_inputs and all(
            isinstance(shape, list) and shape and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
            for shape in group)
        for group in value)
    if not ok:
        raise ManifestError(key, f"expected a non-empty list of {n_inputs}-input shape sets "
                                 "of positive integers")
    return tuple(tuple(tuple(shape) for shape in group) for group in value)


def _parse_manifest(data: object) -> Manifest:
    root = _Reader(data, "")
    fmt = root.get("format", str)
    if fmt != FORMAT:
        raise ManifestError("format", f"{fmt!r} is not a {FORMAT}")
    version = root.data.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise FormatVersionError(version)
    root.only("format", "format_version", "created_by", "target", "model_config",
              "generation_config", "chunk_sizes", "tokenizer", "chat_template", "weights",
              "stages", "experts", "placement", "files")

    files: dict[str, FileEntry] = {}
    files_r = root.obj("files")
    for rel in files_r.data:
        _check_relpath(rel, f"files.{rel}")
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
            shape_sets=_shape_sets(s.get("shape_sets", list), f"stages.{name}.shape_sets",
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
    )
    for key, rel in manifest.referenced_files():
        if rel not in files:
            raise ManifestError(key, f"{rel!r} is not listed in files")
    if manifest.target == "rk3588":
        for name, s in stages.items():
            if s.rknn is None:
                raise ManifestError(f"stages.{name}.rknn", "an rk3588 bundle needs the .rknn")
    if files[manifest.tokenizer].sha256 != manifest.tokenizer_sha256:
        raise ManifestError("tokenizer.sha256", "disagrees with files entry")
    if manifest.chat_template is not None and \
            files[manifest.chat_template].sha256 != manifest.chat_template_sha256:
        raise ManifestError("chat_template.sha256", "disagrees with files entry")
    return manifest


# -- hashing --------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike[str],
                progress: Callable[[int], None] | None = None) -> str:
    """Streamed sha256, so multi-GB expert files never sit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


# -- loading --------------------------------------------------------------------------
@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: Manifest

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        verify: VerifyMode = "stamped",
        expected_template_sha256: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Bundle:
        """Load and check a bundle.

        ``verify``: ``"stamped"`` (default: sha256 of every file, remembered while the
        files are unchanged, see :meth:`verify`), ``"full"`` (sha256 always), ``"size"``
        (stat only: the explicit opt-out) or ``"none"``. ``expected_template_sha256`` is
        the hash of the template the renderer implements
        (``ling3_rknn.chat.TEMPLATE_SHA256``); a different bundle template is a loud
        :class:`TemplateMismatchWarning`, not an error.
        """
        root = Path(root)
        if not root.is_dir():
            raise BundleNotFoundError(f"bundle directory {str(root)!r} does not exist")
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise IncompleteBundleError(
                f"{str(root)!r} has no {MANIFEST}: not a bundle, or an interrupted conversion")
        try:
            data = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError("<root>", f"not valid JSON: {exc}") from exc
        bundle = cls(root, Manifest.from_json(data))
        if verify != "none":
            bundle.verify(verify, progress)
        if expected_template_sha256 is not None:
            bundle.check_template(expected_template_sha256)
        return bundle

    def path(self, relpath: str) -> Path:
        if relpath not in self.manifest.files:
            raise MissingFileError(relpath)
        return self.root / relpath

    def verify(self, mode: VerifyMode = "full",
               progress: Callable[[int], None] | None = None) -> None:
        """Check every manifest file; a typed error names the first bad one.

        Boards run from SD cards and eMMC, where a copy or a write can corrupt bytes
        silently, so the serving default is ``stamped``: a full sha256 check whose success
        is remembered per file (size, mtime, ctime, device, inode), so restarting an
        unchanged bundle costs one ``stat`` per file and any write, copy or replacement
        since is hashed again. What it cannot see is rot on the medium after a successful
        check with no write at all; ``full`` hashes every start. The stamp lives next to the
        manifest, or where the bundle directory is read-only (the systemd unit mounts it
        so) in ``$STATE_DIRECTORY``, ``$LING3_RKNN_STATE_DIR`` or ``~/.cache/ling3-rknn``.
        """
        keys: dict[str, list[int]] = {}
        for rel, entry in self.manifest.files.items():
            p = self.root / rel
            if not p.is_file():
                raise MissingFileError(rel)
            st = p.stat()
            if st.st_size != entry.size:
                raise FileCorruptError(rel, "size", entry.size, st.st_size)
            # ctime cannot be set back by a user (unlike mtime), dev + ino name the file
            keys[rel] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]
        if mode not in ("full", "stamped"):
            return
        trusted = self._read_stamp() if mode == "stamped" else {}
        todo = [rel for rel in keys if trusted.get(rel) != keys[rel]]
        if todo:
            self._hash_files(todo, progress)
        if mode == "stamped" and todo:
            self._write_stamp(keys)

    def _hash_files(self, rels: list[str], progress: Callable[[int], None] | None) -> None:
        total = sum(self.manifest.files[r].size for r in rels)
        done, started, last = 0, time.monotonic(), time.monotonic()

        def count(n: int) -> None:
            nonlocal done, last
            done += n
            if progress is not None:
                progress(n)
            if time.monotonic() - last >= _PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("verifying bundle %s: %.0f / %.0f MiB", self.root.name,
                         done / 2**20, total / 2**20)

        for rel in rels:
            entry = self.manifest.files[rel]
            digest = sha256_file(self.root / rel, count)
            if digest != entry.sha256:
                raise FileCorruptError(rel, "sha256", entry.sha256, digest)
        log.info("bundle %s: sha256 of %d files (%.0f MiB) verified in %.1f s", self.root.name,
                 len(rels), total / 2**20, time.monotonic() - started)

    def _manifest_digest(self) -> str:
        return hashlib.sha256((self.root / MANIFEST).read_bytes()).hexdigest()

    def _stamp_paths(self) -> list[Path]:
        """Where a stamp may live: beside the manifest, then a state directory named for
        this bundle's real path (one stamp per bundle, however many are installed)."""
        state = (os.environ.get("STATE_DIRECTORY", "").split(":")[0]  # systemd
                 or os.environ.get("LING3_RKNN_STATE_DIR")
                 or os.path.join(os.path.expanduser("~"), ".cache", "ling3-rknn"))
        name = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:16]
        return [self.root / STAMP, Path(state) / f"verified-{name}.json"]

    def _read_stamp(self) -> dict[str, list[int]]:
        """Files an earlier full check verified, keyed by their stat; empty when no stamp
        is readable or it belongs to another manifest."""
        digest = self._manifest_digest()
        for path in self._stamp_paths():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("manifest_sha256") == digest:
                    return {str(k): list(v) for k, v in data["files"].items()}
            except (OSError, ValueError, AttributeError, KeyError, TypeError):
                continue
        return {}

    def _write_stamp(self, keys: dict[str, list[int]]) -> None:
        """Atomic; with no writable place the next start just hashes again."""
        body = json.dumps({"manifest_sha256": self._manifest_digest(), "files": keys})
        for path in self._stamp_paths():
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(body, encoding="utf-8")
                os.replace(tmp, path)
                return
            except OSError:
                tmp.unlink(missing_ok=True)
        log.info("bundle %s: no writable place for the verification stamp; the next start "
                 "hashes again", self.root.name)

    def check_template(self, expected_sha256: str) -> bool:
        actual = self.manifest.chat_template_sha256
        if actual == expected_sha256:
            return True
        msg = (f"bundle {self.root.name!r} carries chat template sha256 {actual} but the "
               f"renderer implements {expected_sha256}; prompts may not match what the model "
               "was trained on")
        log.warning(msg)
        warnings.warn(msg, TemplateMismatchWarning, stacklevel=2)
        return False


# -- writing --------------------------------------------------------------------------
class BundleWriter:
    """Builds a bundle in a hidden directory next to ``target``; :meth:`commit` hashes
    every file, writes the manifest last and renames the directory into place.

    Without ``resume`` the work directory is ``.<name>.partial-<id>`` and leaving the
    ``with`` block without committing removes it. With ``resume`` it is ``.<name>.partial``
    and survives a failure: files completed through :meth:`write_bytes`, :meth:`copy_file`
    or :meth:`record` are journaled (size, mtime, sha256), :meth:`done` tells the converter
    what it can skip on the next run, and anything unjournaled (half-written when the
    process died) is deleted on re-entry.
    """

    def __init__(self, target: str | os.PathLike[str], overwrite: bool = False,
                 resume: bool = False) -> None:
        self.target = Path(target)
        self.overwrite = overwrite
        self.resume = resume
        suffix = "partial" if resume else f"partial-{uuid.uuid4().hex[:8]}"
        self.workdir = self.target.parent / f".{self.target.name}.{suffix}"
        self._journal: dict[str, dict[str, Any]] = {}
        self._committed = False

    @property
    def _journal_path(self) -> Path:
        return self.workdir / _JOURNAL

    def __enter__(self) -> BundleWriter:
        if self.target.exists() and not self.overwrite:
            raise BundleExistsError(f"{str(self.target)!r} exists; pass overwrite to replace it")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        if self.resume and self.workdir.is_dir():
            self._load_journal()
        else:
            self.workdir.mkdir()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed and not self.resume:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _load_journal(self) -> None:
        entries: dict[str, dict[str, Any]] = {}
        if self._journal_path.is_file():
            for line in self._journal_path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    entries[entry["path"]] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn last line from a crash
        for rel, entry in list(entries.items()):
            p = self.workdir / rel
            st = p.stat() if p.is_file() else None
            if st is None or st.st_size != entry["size"] or st.st_mtime_ns != entry["mtime_ns"]:
                del entries[rel]
        for p in self._files():
            rel = p.relative_to(self.workdir).as_posix()
            if rel not in entries:
                p.unlink()
        self._journal = entries
        with open(self._journal_path, "w", encoding="utf-8") as f:
            for entry in entries.values():
                f.write(json.dumps(entry) + "\n")

    def _files(self) -> list[Path]:
        return [p for p in sorted(self.workdir.rglob("*"))
                if p.is_file() and p.name != _JOURNAL]

    def done(self, relpath: str) -> bool:
        """Whether ``relpath`` was completed (and journaled) by this or an earlier run."""
        return relpath in self._journal

    def record(self, relpath: str, progress: Callable[[int], None] | None = None) -> None:
        """Mark a file written through :meth:`path` as complete."""
        p = self.workdir / _check_relpath(relpath, relpath)
        if not p.is_file():
            raise MissingFileError(relpath)
        st = p.stat()
        entry = {"path": relpath, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                 "sha256": sha256_file(p, progress)}
        self._journal[relpath] = entry
        with open(self._journal_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def path(self, relpath: str) -> Path:
        """Where to write ``relpath`` (parent directories are created)."""
        p = self.workdir / _check_relpath(relpath, relpath)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_bytes(self, relpath: str, data: bytes) -> Path:
        p = self.path(relpath)
        p.write_bytes(data)
        self.record(relpath)
        return p

    def copy_file(self, relpath: str, src: str | os.PathLike[str]) -> Path:
        p = self.path(relpath)
        shutil.copyfile(src, p)
        self.record(relpath)
        return p

    def commit(self, manifest: Mapping[str, Any],
               progress: Callable[[int], None] | None = None) -> Path:
        """``manifest``: every manifest field except ``format``, ``format_version`` and
        ``files`` (computed here). Validated with the loader's parser before anything
        is renamed, so a committed bundle always opens."""
        files = {}
        for p in self._files():
            rel = p.relative_to(self.workdir).as_posix()
            if rel == MANIFEST:
                raise BundleError(f"{MANIFEST} is written by commit()")
            # safetensors writes 0600; a bundle is read by another user (the service).
            p.chmod(0o644)
            st = p.stat()
            known = self._journal.get(rel)
            if known is not None and (known["size"], known["mtime_ns"]) == (st.st_size,
                                                                         st.st_mtime_ns):
                files[rel] = {"size": st.st_size, "sha256": known["sha256"]}
            else:
                files[rel] = {"size": st.st_size, "sha256": sha256_file(p, progress)}
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": files}
        parsed = Manifest.from_json(json.loads(json.dumps(body)))  # schema check, no side effects
        manifest_path = self.workdir / MANIFEST
        tmp = manifest_path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(parsed.to_json(), f, indent=1, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, manifest_path)
        manifest_path.chmod(0o644)
        for d in (self.workdir, *(q for q in self.workdir.rglob("*") if q.is_dir())):
            d.chmod(0o755)
        self._journal_path.unlink(missing_ok=True)
        old = None
        if self.target.exists():
            if not self.overwrite:
                raise BundleExistsError(f"{str(self.target)!r} appeared during conversion")
            old = self.target.parent / f".{self.target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.target, old)
        os.replace(self.workdir, self.target)
        self._committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.target

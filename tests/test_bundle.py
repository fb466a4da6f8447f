"""Bundle writer and loader: round trip, atomic commit, and every bad-input path."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest

from ling3_rknn.bundle import (
    FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    STAMP,
    Bundle,
    BundleError,
    BundleExistsError,
    BundleNotFoundError,
    BundleWriter,
    FileCorruptError,
    FormatVersionError,
    IncompleteBundleError,
    ManifestError,
    MissingFileError,
    TemplateMismatchWarning,
    sha256_file,
)

TEMPLATE = b"{% for m in messages %}{{ m.content }}{% endfor %}"
TEMPLATE_SHA = hashlib.sha256(TEMPLATE).hexdigest()


def manifest_body(target: str = "rk3588") -> dict:
    spec = {"onnx": "stages/layer0.in.onnx", "rknn": "stages/layer0.in.rknn", "quant": "w8a8",
            "inputs": ["hidden"], "outputs": ["q", "gate"],
            "shape_sets": [[[1, 1, 64]], [[1, 64, 64]]], "input_dtype": "float32",
            "nbytes": 11}
    if target == "cpu":
        spec = {**spec, "rknn": None, "quant": "fp32"}
    return {
        "created_by": "test",
        "target": target,
        "model_config": {"hidden_size": 64, "num_hidden_layers": 4},
        "generation_config": {"temperature": 0.7},
        "chunk_sizes": [1, 64],
        "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(b"{}").hexdigest()},
        "chat_template": {"file": "chat_template.jinja", "sha256": TEMPLATE_SHA},
        "weights": "weights.safetensors",
        "stages": {"layer0.in": spec},
        "experts": {"format": "int4", "block_size": 32, "top_k": 2,
                    "layers": {"1": {"weights": "experts/layer1.safetensors",
                                     "onnx": "experts/layer1.onnx"}}},
        "placement": {"stage_cores": {"layer0.in": "0"}, "npu_experts": {"1": [3, 5]},
                      "npu_budget_bytes": 1000},
    }


def write_bundle(target: Path, body: dict | None = None, overwrite: bool = False) -> Path:
    body = body or manifest_body()
    with BundleWriter(target, overwrite=overwrite) as w:
        w.write_bytes("tokenizer.json", b"{}")
        w.write_bytes("chat_template.jinja", TEMPLATE)
        w.write_bytes("weights.safetensors", b"W" * 1000)
        w.write_bytes("stages/layer0.in.onnx", b"onnx-bytes")
        if body["target"] == "rk3588":
            w.write_bytes("stages/layer0.in.rknn", b"rknn-bytes!")
        w.write_bytes("experts/layer1.safetensors", b"E" * 5000)
        w.write_bytes("experts/layer1.onnx", b"qmoe")
        return w.commit(body)


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return write_bundle(tmp_path / "model.bundle")


def edit_manifest(root: Path, fn) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_round_trip(bundle_dir):
    b = Bundle.open(bundle_dir, verify="full", expected_template_sha256=TEMPLATE_SHA)
    m = b.manifest
    assert m.format_version == FORMAT_VERSION and m.target == "rk3588"
    assert m.chunk_sizes == (1, 64)
    s = m.stages["layer0.in"]
    assert s.shape_sets == (((1, 1, 64),), ((1, 64, 64),)) and s.outputs == ("q", "gate")
    assert m.experts.layers[1]["onnx"] == "experts/layer1.onnx"
    assert m.placement.npu_experts == {1: (3, 5)}
    assert m.placement.stage_cores == {"layer0.in": "0"}
    assert m.files["weights.safetensors"].size == 1000
    assert m.files["weights.safetensors"].sha256 == sha256_file(bundle_dir / "weights.safetensors")
    assert b.path("experts/layer1.onnx").read_bytes() == b"qmoe"
    assert set(m.files) == {p.relative_to(bundle_dir).as_posix()
                            for p in bundle_dir.rglob("*") if p.is_file()} - {"manifest.json"}
    # a re-serialised manifest parses to the same thing
    assert type(m).from_json(m.to_json()) == m


def test_cpu_target_bundle_needs_no_rknn(tmp_path):
    b = Bundle.open(write_bundle(tmp_path / "cpu", manifest_body("cpu")))
    assert b.manifest.stages["layer0.in"].rknn is None


def test_no_partial_directory_survives_a_failed_conversion(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), BundleWriter(target) as w:
        w.write_bytes("weights.safetensors", b"x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_schema_error_at_commit_leaves_nothing(tmp_path):
    body = manifest_body()
    body["stages"]["layer0.in"]["quant"] = "w4a16"
    with pytest.raises(ManifestError, match="quant"):
        write_bundle(tmp_path / "out", body)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_conversion_does_not_look_valid(tmp_path):
    """A writer killed before commit leaves only a hidden .partial directory, and even a
    directory with files but no manifest is refused."""
    w = BundleWriter(tmp_path / "out").__enter__()
    w.write_bytes("weights.safetensors", b"x")
    assert not (tmp_path / "out").exists()
    assert w.workdir.name.startswith(".out.partial-")
    with pytest.raises(IncompleteBundleError, match="interrupted"):
        Bundle.open(w.workdir)


def test_existing_target(tmp_path, bundle_dir):
    with pytest.raises(BundleExistsError):
        write_bundle(bundle_dir)
    body = manifest_body()
    body["created_by"] = "second"
    write_bundle(bundle_dir, body, overwrite=True)
    assert Bundle.open(bundle_dir).manifest.created_by == "second"
    assert sorted(p.name for p in bundle_dir.parent.iterdir()) == ["model.bundle"]


def test_missing_directory_and_manifest(tmp_path):
    with pytest.raises(BundleNotFoundError):
        Bundle.open(tmp_path / "nope")
    with pytest.raises(IncompleteBundleError):
        Bundle.open(tmp_path)


def test_missing_file(bundle_dir):
    (bundle_dir / "experts" / "layer1.onnx").unlink()
    with pytest.raises(MissingFileError, match=r"experts/layer1\.onnx"):
        Bundle.open(bundle_dir, verify="size")


def test_flipped_byte_is_caught_by_full_verification_only(bundle_dir):
    path = bundle_dir / "experts" / "layer1.safetensors"
    data = bytearray(path.read_bytes())
    data[2500] ^= 0x01
    path.write_bytes(bytes(data))
    Bundle.open(bundle_dir, verify="size")  # same size: the fast mode cannot see it
    with pytest.raises(FileCorruptError, match=r"layer1\.safetensors.*sha256"):
        Bundle.open(bundle_dir, verify="full")


def test_default_verification_hashes_and_remembers(bundle_dir):
    """The default (stamped) catches a flipped byte; once a bundle verified, reopening it
    unchanged hashes nothing, and a file that changed since is hashed again."""
    seen: list[int] = []
    Bundle.open(bundle_dir, progress=seen.append)
    assert sum(seen) > 0 and (bundle_dir / STAMP).is_file()
    seen.clear()
    Bundle.open(bundle_dir, progress=seen.append)
    assert seen == []  # unchanged: one stat per file
    path = bundle_dir / "experts" / "layer1.safetensors"
    data = bytearray(path.read_bytes())
    data[2500] ^= 0x01
    before = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))  # same size, new mtime (pinned past a coarse clock tick)
    os.utime(path, ns=(before + 10**9, before + 10**9))
    with pytest.raises(FileCorruptError, match=r"layer1\.safetensors.*sha256"):
        Bundle.open(bundle_dir, progress=seen.append)
    assert sum(seen) == path.stat().st_size  # only the changed file was hashed again


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _forge_stamp(bundle_dir: Path, rel: str, manifest_sha256: str | None = None) -> None:
    """A stamp that claims ``rel`` as it is now was verified."""
    stamp = json.loads((bundle_dir / STAMP).read_text())
    st = (bundle_dir / rel).stat()
    stamp["files"][rel] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]
    if manifest_sha256 is not None:
        stamp["manifest_sha256"] = manifest_sha256
    (bundle_dir / STAMP).write_text(json.dumps(stamp))


def test_a_stamp_of_another_manifest_is_ignored(bundle_dir):
    Bundle.open(bundle_dir)
    rel = "experts/layer1.safetensors"
    _flip_byte(bundle_dir / rel, 10)
    _forge_stamp(bundle_dir, rel, manifest_sha256="0" * 64)
    with pytest.raises(FileCorruptError):
        Bundle.open(bundle_dir)


def test_an_unreadable_stamp_is_ignored(bundle_dir):
    Bundle.open(bundle_dir)
    _flip_byte(bundle_dir / "experts" / "layer1.safetensors", 10)
    (bundle_dir / STAMP).write_text("not json")
    with pytest.raises(FileCorruptError):
        Bundle.open(bundle_dir)


def test_the_stamp_vouches_only_for_unchanged_files(bundle_dir):
    """What the stamp trusts, stated: a file whose stat (size, mtime, ctime, device,
    inode) matches a stamp of this manifest is not hashed again. A stamp forged for the
    new stat is trusted (the stamp guards against accidents, not against an attacker who
    can write the bundle), which is why ``full`` exists."""
    Bundle.open(bundle_dir)
    rel = "experts/layer1.safetensors"
    _flip_byte(bundle_dir / rel, 10)
    _forge_stamp(bundle_dir, rel)
    Bundle.open(bundle_dir)  # trusted: the documented limit
    with pytest.raises(FileCorruptError):
        Bundle.open(bundle_dir, verify="full")


def test_a_read_only_bundle_keeps_its_stamp_in_the_state_directory(bundle_dir, tmp_path,
                                                                     monkeypatch):
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("LING3_RKNN_STATE_DIR", str(tmp_path / "state"))
    (bundle_dir / STAMP).mkdir()  # the bundle directory cannot take the stamp file
    seen: list[int] = []
    Bundle.open(bundle_dir, progress=seen.append)
    assert sum(seen) > 0
    assert len(list((tmp_path / "state").glob("verified-*.json"))) == 1
    seen.clear()
    Bundle.open(bundle_dir, progress=seen.append)
    assert seen == []  # the state directory's stamp is used on the next start


def test_truncated_file_is_caught_by_the_fast_mode(bundle_dir):
    path = bundle_dir / "weights.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(FileCorruptError, match="size is 999, manifest says 1000"):
        Bundle.open(bundle_dir)


def test_full_verification_streams_with_progress(bundle_dir):
    seen = []
    Bundle.open(bundle_dir, verify="full", progress=seen.append)
    assert sum(seen) == sum(p.stat().st_size for p in bundle_dir.rglob("*")
                            if p.is_file() and p.name != "manifest.json")


@pytest.mark.parametrize("version,match", [
    (FORMAT_VERSION + 1, "newer"), (min(READABLE_FORMAT_VERSIONS) - 1, "re-convert"),
    (0, "re-convert"),
    ("1", "re-convert"), (None, "None"),
    (True, "re-convert"),
])
def test_other_format_versions(bundle_dir, version, match):
    edit_manifest(bundle_dir, lambda m: m.__setitem__("format_version", version))
    with pytest.raises(FormatVersionError, match=match):
        Bundle.open(bundle_dir)


def _with_npu_copy(target: Path, version: int = FORMAT_VERSION) -> Path:
    body = {**manifest_body(), "npu_matmul_experts": {
        "format": "int8", "layers": {"1": "experts/layer1.npu.safetensors"}}}
    with BundleWriter(target) as w:
        for rel, data in (("tokenizer.json", b"{}"), ("chat_template.jinja", TEMPLATE),
                          ("weights.safetensors", b"W" * 1000),
                          ("stages/layer0.in.onnx", b"onnx-bytes"),
                          ("stages/layer0.in.rknn", b"rknn-bytes!"),
                          ("experts/layer1.safetensors", b"E" * 5000),
                          ("experts/layer1.onnx", b"qmoe"),
                          ("experts/layer1.npu.safetensors", b"N" * 8000)):
            w.write_bytes(rel, data)
        root = w.commit(body)
    edit_manifest(root, lambda m: m.__setitem__("format_version", version))
    return root


def test_npu_copy_round_trip_and_its_bytes(tmp_path):
    b = Bundle.open(_with_npu_copy(tmp_path / "b"), verify="full")
    spec = b.manifest.npu_matmul_experts
    assert spec is not None and spec.format == "int8"
    assert spec.layers == {1: "experts/layer1.npu.safetensors"}
    assert b.manifest.npu_matmul_expert_bytes() == 8000
    # the copy counts in what loading brings into memory only when it is taken
    assert b.loaded_bytes(npu_graphs=True, npu_matmul_experts=True) == \
        b.loaded_bytes(npu_graphs=True) + 8000
    again = json.loads(json.dumps(b.manifest.to_json()))
    assert Bundle(b.root, b.manifest.from_json(again)).manifest == b.manifest


def test_a_version_2_bundle_loads_without_the_copy_and_may_not_name_one(bundle_dir, tmp_path):
    edit_manifest(bundle_dir, lambda m: m.__setitem__("format_version", 2))
    m = Bundle.open(bundle_dir).manifest
    assert m.format_version == 2 and m.npu_matmul_experts is None
    assert m.npu_matmul_expert_bytes() == 0
    with pytest.raises(ManifestError, match="npu_matmul_experts"):
        Bundle.open(_with_npu_copy(tmp_path / "v2", version=2))


@pytest.mark.parametrize("edit,match", [
    ("format", "int8"),
    ("layers", "at least one layer"),
    ("key", "layer indices"),
    ("unlisted", "not listed in files"),
    ("no-cpu", "no CPU experts"),
])
def test_bad_npu_copy_entries(tmp_path, edit, match):
    root = _with_npu_copy(tmp_path / "b")

    def fn(m):
        entry = m["npu_matmul_experts"]
        if edit == "format":
            entry["format"] = "int4"
        elif edit == "layers":
            entry["layers"] = {}
        elif edit == "key":
            entry["layers"] = {"x": "experts/layer1.npu.safetensors"}
        elif edit == "unlisted":
            entry["layers"] = {"1": "experts/other.npu.safetensors"}
        else:
            entry["layers"]["2"] = "experts/layer1.npu.safetensors"

    edit_manifest(root, fn)
    with pytest.raises(ManifestError, match=match):
        Bundle.open(root, verify="none")


def test_a_corrupt_or_missing_npu_copy_is_a_typed_error(tmp_path):
    root = _with_npu_copy(tmp_path / "b")
    (root / "experts/layer1.npu.safetensors").write_bytes(b"M" * 8000)
    with pytest.raises(FileCorruptError, match=r"layer1\.npu\.safetensors"):
        Bundle.open(root, verify="full")
    (root / "experts/layer1.npu.safetensors").unlink()
    with pytest.raises(MissingFileError, match=r"layer1\.npu\.safetensors"):
        Bundle.open(root, verify="size")


def test_manifest_not_json(bundle_dir):
    (bundle_dir / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Bundle.open(bundle_dir)


def _set(path: str, value):
    def fn(m):
        *parents, last = path.split("/")
        node = m
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return fn


@pytest.mark.parametrize("edit,key", [
    (_set("format", "something-else"), "format"),
    (_set("target", "rk3576"), "target"),
    (_set("chunk_sizes", []), "chunk_sizes"),
    (_set("chunk_sizes", [1, 0]), "chunk_sizes"),
    (_set("weights", "../outside.safetensors"), "weights"),
    (_set("weights", "/abs/weights.safetensors"), "weights"),
    (_set("weights", "not-listed.bin"), "weights"),
    (_set("surprise", 1), "<root>"),
    (_set("tokenizer/sha256", "abc"), "tokenizer.sha256"),
    (_set("tokenizer/sha256", "0" * 64), "tokenizer.sha256"),
    (_set("model_config", []), "model_config"),
    (_set("stages/layer0.in/quant", "int4"), "stages.layer0.in.quant"),
    (_set("stages/layer0.in/inputs", ["a", "a"]), "stages.layer0.in.inputs"),
    (_set("stages/layer0.in/shape_sets", [[[1, 0, 64]]]), "stages.layer0.in.shape_sets"),
    (_set("stages/layer0.in/shape_sets", [[[1, 1, 64], [1, 1, 64]]]),
     "stages.layer0.in.shape_sets"),
    (_set("stages/layer0.in/rknn", None), "stages.layer0.in.rknn"),
    (_set("stages/layer0.in/nbytes", True), "stages.layer0.in.nbytes"),
    (_set("stages/layer0.in/onnx", KeyError), "stages.layer0.in.onnx"),
    (_set("experts/format", "int3"), "experts.format"),
    (_set("experts/layers/x", {}), "experts.layers.x"),
    (_set("placement/stage_cores/layer9.out", "0"), "placement.stage_cores.layer9.out"),
    (_set("placement/stage_cores/layer0.in", "3"), "placement.stage_cores.layer0.in"),
    (_set("placement/npu_experts/1", [-1]), "placement.npu_experts.1"),
    (_set("files/weights.safetensors/size", -5), "files.weights.safetensors.size"),
])
def test_schema_errors_name_the_key(bundle_dir, edit, key):
    edit_manifest(bundle_dir, edit)
    with pytest.raises(ManifestError) as info:
        Bundle.open(bundle_dir, verify="none")
    assert info.value.key == key


def test_every_error_is_a_bundle_error():
    for cls in (BundleNotFoundError, IncompleteBundleError, ManifestError, FormatVersionError,
                MissingFileError, FileCorruptError, BundleExistsError):
        assert issubclass(cls, BundleError)


def test_template_mismatch_is_a_loud_warning(bundle_dir, caplog):
    with pytest.warns(TemplateMismatchWarning, match="renderer implements"):
        Bundle.open(bundle_dir, expected_template_sha256="f" * 64)
    assert "chat template" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Bundle.open(bundle_dir, expected_template_sha256=TEMPLATE_SHA)


def test_path_refuses_unlisted_files(bundle_dir):
    with pytest.raises(MissingFileError):
        Bundle.open(bundle_dir).path("secret.txt")


def test_writer_refuses_escaping_paths(tmp_path):
    with BundleWriter(tmp_path / "b") as w, pytest.raises(ManifestError):
        w.write_bytes("../evil", b"x")


def test_resumable_conversion_keeps_completed_files_only(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), BundleWriter(target, resume=True) as w:
        w.write_bytes("tokenizer.json", b"{}")
        w.write_bytes("chat_template.jinja", TEMPLATE)
        w.path("weights.safetensors").write_bytes(b"half-writ")  # died mid-write
        raise RuntimeError("killed")
    assert not target.exists() and (tmp_path / ".out.partial").is_dir()
    with pytest.raises(IncompleteBundleError):
        Bundle.open(tmp_path / ".out.partial")

    with BundleWriter(target, resume=True) as w:
        assert w.done("tokenizer.json") and w.done("chat_template.jinja")
        assert not w.done("weights.safetensors")
        assert not (w.workdir / "weights.safetensors").exists()  # the torn file is gone
        w.write_bytes("weights.safetensors", b"W" * 1000)
        w.path("stages/layer0.in.onnx").write_bytes(b"onnx-bytes")
        w.record("stages/layer0.in.onnx")
        w.write_bytes("stages/layer0.in.rknn", b"rknn-bytes!")
        w.write_bytes("experts/layer1.safetensors", b"E" * 5000)
        w.write_bytes("experts/layer1.onnx", b"qmoe")
        w.commit(manifest_body())
    b = Bundle.open(target, verify="full", expected_template_sha256=TEMPLATE_SHA)
    assert ".journal.jsonl" not in b.manifest.files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_drops_journal_entries_whose_file_changed(tmp_path):
    with pytest.raises(RuntimeError), BundleWriter(tmp_path / "o", resume=True) as w:
        w.write_bytes("tokenizer.json", b"{}")
        w.write_bytes("weights.safetensors", b"abc")
        raise RuntimeError
    (tmp_path / ".o.partial" / "weights.safetensors").write_bytes(b"abcd")
    with open(tmp_path / ".o.partial" / ".journal.jsonl", "a") as f:
        f.write('{"path": "torn')  # a crash in the middle of a journal line
    with BundleWriter(tmp_path / "o", resume=True) as w:
        assert w.done("tokenizer.json") and not w.done("weights.safetensors")
        assert not (w.workdir / "weights.safetensors").exists()
    with pytest.raises(MissingFileError), BundleWriter(tmp_path / "p") as w:
        w.record("never-written.bin")


def test_committed_files_are_readable_by_the_service_user(tmp_path):
    """The converter runs as one user, the service as another: 0644 files, 0755 dirs,
    whatever the writers left (safetensors writes 0600)."""
    body = manifest_body()
    with BundleWriter(tmp_path / "b", overwrite=False) as w:
        for rel, data in (("tokenizer.json", b"{}"), ("chat_template.jinja", TEMPLATE),
                          ("weights.safetensors", b"W" * 1000),
                          ("stages/layer0.in.onnx", b"onnx-bytes"),
                          ("stages/layer0.in.rknn", b"rknn-bytes!"),
                          ("experts/layer1.safetensors", b"E" * 5000),
                          ("experts/layer1.onnx", b"qmoe")):
            w.path(rel).write_bytes(data)
            w.path(rel).chmod(0o600)
            w.path(rel).parent.chmod(0o700)
            w.record(rel)
        bundle_dir = w.commit(body)
    for p in [bundle_dir, *bundle_dir.rglob("*")]:
        want = 0o755 if p.is_dir() else 0o644
        assert p.stat().st_mode & 0o777 == want, p

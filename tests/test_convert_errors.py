"""Bad input to the converter and to ``Model.from_bundle``: each a clear, typed error,
and never a half-written bundle at the output path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, ORACLE_DIR, ORACLE_FIXTURES
from safetensors.numpy import load_file, save_file

from convert.calibration import CalibrationError
from convert.converter import ConvertError, ConvertOptions, convert
from ling3_rknn.bundle import (
    FORMAT_VERSION,
    FileCorruptError,
    FormatVersionError,
    MissingFileError,
    TemplateMismatchWarning,
)
from ling3_rknn.chat import TEMPLATE_SHA256
from ling3_rknn.cli import main
from ling3_rknn.config import ConfigError
from ling3_rknn.model import CheckpointError, Model
from ling3_rknn.model.bundle_executors import check_not_placeholder
from ling3_rknn.npu import NpuError

TOKENIZER = FIXTURES / "tokenizer" / "compact" / "tokenizer.json"
SRC = ORACLE_DIR / ORACLE_FIXTURES[1]


def opts(tmp: Path, **kw) -> ConvertOptions:
    calib = tmp / "calib.jsonl"
    if not calib.exists():
        rng = np.random.default_rng(0)
        calib.write_text("\n".join(json.dumps({"ids": rng.integers(2, 256, 40).tolist()})
                                   for _ in range(2)))
    base = dict(chunk=8, tokenizer=TOKENIZER, build_rknn=False, progress=False,
                calibration=calib, block_size=16, experts="fp16", npu_budget=0)
    base.update(kw)
    return ConvertOptions(**base)


def copy_checkpoint(tmp: Path) -> Path:
    dst = tmp / "hf"
    shutil.copytree(SRC, dst)
    return dst


def assert_nothing_written(tmp: Path) -> None:
    assert not (tmp / "out").exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith(".out.partial")]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    convert(SRC, tmp / "b", opts(tmp))
    return tmp / "b"


def fresh_copy(bundle: Path, tmp: Path) -> Path:
    dst = tmp / "copy"
    shutil.copytree(bundle, dst)
    return dst


# --------------------------------------------------------------------------- checkpoints
def test_truncated_safetensors(tmp_path) -> None:
    hf = copy_checkpoint(tmp_path)
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"truncated|beyond|exceeds|size"):
        convert(hf, tmp_path / "out", opts(tmp_path))
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("key,value,error,match", [
    ("model_type", "llama", ConfigError, "model_type"),  # wrong config
    ("moe_intermediate_size", 32, CheckpointError, "shape"),  # config disagrees with tensors
])
def test_bad_config(tmp_path, key, value, error, match) -> None:
    hf = copy_checkpoint(tmp_path)
    cfg = json.loads((hf / "config.json").read_text())
    cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=match):
        convert(hf, tmp_path / "out", opts(tmp_path))
    assert_nothing_written(tmp_path)


def test_missing_tensor(tmp_path) -> None:
    hf = copy_checkpoint(tmp_path)
    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.3.post_attention_layernorm.weight"]
    save_file(tensors, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError, match="post_attention_layernorm"):
        convert(hf, tmp_path / "out", opts(tmp_path))
    assert_nothing_written(tmp_path)


def test_missing_tokenizer(tmp_path) -> None:
    with pytest.raises(ConvertError, match="tokenizer"):
        convert(SRC, tmp_path / "out", opts(tmp_path, tokenizer=tmp_path / "nope.json"))


def test_tokenizer_beyond_the_vocabulary(tmp_path) -> None:
    with pytest.raises(CalibrationError, match="outside the model's vocabulary"):
        convert(SRC, tmp_path / "out", opts(tmp_path, calibration=None))
    assert_nothing_written(tmp_path)


def test_bad_calibration_file(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n{"ids": [1, "x"]}\n')
    with pytest.raises(CalibrationError, match=r"bad\.jsonl:2"):
        convert(SRC, tmp_path / "out", opts(tmp_path, calibration=bad))


def test_bad_options(tmp_path) -> None:
    with pytest.raises(ConvertError, match="--quant"):
        convert(SRC, tmp_path / "out", opts(tmp_path, quant="int4"))


def test_interrupted_conversion_leaves_nothing_then_resumes(tmp_path) -> None:
    seen: list[str] = []

    def crash(stage: str) -> None:
        seen.append(stage)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(SRC, tmp_path / "out", opts(tmp_path, resume=True), on_stage=crash)
    assert not (tmp_path / "out").exists()
    partial = tmp_path / ".out.partial"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    done: list[str] = []
    convert(SRC, tmp_path / "out", opts(tmp_path, resume=True), on_stage=done.append)
    assert not partial.exists()
    Model.from_bundle(tmp_path / "out", executor="mock", verify="full")


def test_existing_output_is_not_replaced(tmp_path, bundle) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Exception, match="exists"):
        convert(SRC, out, opts(tmp_path))


# --------------------------------------------------------------------------- bundles
def test_flipped_byte(tmp_path, bundle) -> None:
    b = fresh_copy(bundle, tmp_path)
    f = b / "stages" / "layer.3.out.onnx"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(FileCorruptError, match=r"layer\.3\.out\.onnx.*sha256"):
        Model.from_bundle(b, executor="mock", verify="full")


def test_truncated_bundle_file(tmp_path, bundle) -> None:
    b = fresh_copy(bundle, tmp_path)
    f = b / "weights.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(FileCorruptError, match="size"):
        Model.from_bundle(b, executor="mock")


def test_missing_bundle_file(tmp_path, bundle) -> None:
    b = fresh_copy(bundle, tmp_path)
    (b / "experts" / "layer_02.safetensors").unlink()
    with pytest.raises(MissingFileError, match="layer_02"):
        Model.from_bundle(b, executor="mock")


def test_other_format_version(tmp_path, bundle) -> None:
    b = fresh_copy(bundle, tmp_path)
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatVersionError, match=f"version {FORMAT_VERSION + 1}"):
        Model.from_bundle(b, executor="mock")


def test_placeholder_rknn_refused_by_a_real_runtime(bundle) -> None:
    from ling3_rknn.bundle import Bundle

    class BoardRKNNLite:  # stands for rknnlite.api.RKNNLite; only its identity matters
        pass

    with pytest.raises(NpuError, match="placeholder"):
        check_not_placeholder(Bundle.open(bundle), "final", BoardRKNNLite)


def test_board_runtime_missing_on_host(bundle) -> None:
    with pytest.raises(NpuError, match="rknn-toolkit-lite2"):
        Model.from_bundle(bundle, executor="rknnlite")


def test_foreign_chat_template_warns(tmp_path) -> None:
    from ling3_rknn.bundle import Bundle

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    convert(SRC, tmp_path / "out", opts(tmp_path, chat_template=template))
    with pytest.warns(TemplateMismatchWarning):
        Bundle.open(tmp_path / "out", expected_template_sha256=TEMPLATE_SHA256)


# --------------------------------------------------------------------------- CLI
def test_cli_convert(tmp_path, capsys) -> None:
    o = opts(tmp_path)
    args = ["convert", str(SRC), str(tmp_path / "out"), "--tokenizer", str(TOKENIZER),
            "--chunk", "8", "--block-size", "16", "--no-rknn-build",
            "--calibration", str(o.calibration), "--npu-budget", "0"]
    assert main(args) == 0
    assert "bundle written" in capsys.readouterr().out
    Model.from_bundle(tmp_path / "out", executor="mock")
    assert main(args) == 1  # exists
    assert "exists" in capsys.readouterr().err


def test_cli_convert_bad_checkpoint(tmp_path, capsys) -> None:
    hf = copy_checkpoint(tmp_path)
    (hf / "model.safetensors").write_bytes(b"\x00" * 4)
    assert main(["convert", str(hf), str(tmp_path / "out"), "--tokenizer",
                 str(TOKENIZER)]) == 1
    assert "CheckpointError" in capsys.readouterr().err
    assert_nothing_written(tmp_path)


def test_cli_convert_bad_w8a8_hybrid_threshold(tmp_path, capsys) -> None:
    args = ["convert", str(SRC), str(tmp_path / "out"), "--tokenizer", str(TOKENIZER),
            "--quant", "w8a8", "--w8a8-hybrid-cos", "1.5", "--no-rknn-build"]
    assert main(args) == 1
    assert "ConvertError" in capsys.readouterr().err
    assert_nothing_written(tmp_path)

"""Checkpoint loading: spellings, bf16, sharding, laziness, and typed errors for bad files."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import ORACLE_DIR
from safetensors.numpy import load_file, save_file

from ling3_rknn.model import Checkpoint, CheckpointError, Model
from ling3_rknn.model.checkpoint import canonical_name
from ling3_rknn.model.safetensors_file import SafetensorsFile, bf16_to_float32

F32_FIXTURE = ORACLE_DIR / "lora_hfsave"  # float32, transformers save_pretrained names


def write_raw(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file with arbitrary dtype tags (the numpy API cannot write bf16)."""
    header, offset, blobs = {}, 0, []
    for name, (tag, shape, data) in tensors.items():
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def copy_fixture(tmp_path: Path, edit=None) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(F32_FIXTURE, out)
    if edit is not None:
        tensors = load_file(out / "model.safetensors")
        edit(tensors)
        save_file(tensors, out / "model.safetensors")
    return out


def test_bf16_widening_is_exact():
    values = np.array([1.0, -2.5, 3.140625, 0.0, -0.0, 65280.0, 1e-30], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    widened = bf16_to_float32(bits)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened[:6], values[:6])
    # 1e-30 is not a bfloat16 value: the bits above were cut (truncated, not rounded) to 8
    # significand bits, one ulp 2^-7 relative at most; the widening adds nothing
    assert abs(widened[6] - 1e-30) / 1e-30 < 2.0**-7


def test_bf16_and_f16_files_load_as_float32(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    bf = (a.view(np.uint32) >> 16).astype("<u2").tobytes()
    write_raw(
        tmp_path / "m.safetensors",
        {
            "x": ("BF16", [2, 3], bf),
            "y": ("F16", [3], np.array([1, 2, 3], "<f2").tobytes()),
        },
    )
    f = SafetensorsFile(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(f.float32("x"), a)
    assert f.float32("y").dtype == np.float32
    np.testing.assert_array_equal(f.float32_rows("x", np.array([1])), a[1:])


def test_float32_tensors_are_lazy_read_only_views():
    ckpt = Checkpoint.open(F32_FIXTURE)
    t = ckpt.tensor("lm_head.weight", (256, 32))
    assert not t.flags.owndata and not t.flags.writeable  # memory-mapped, not copied


def test_missing_tensor_names_it_and_its_shape(tmp_path):
    path = copy_fixture(tmp_path, lambda t: t.pop("model.layers.1.attention.q_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        Model.from_hf(path)
    assert "model.layers.1.attention.q_proj.weight" in str(e.value)
    assert "[48, 32]" in str(e.value)


def test_missing_expert_fails_at_load(tmp_path):
    name = "model.layers.5.mlp.experts.3.down_proj.weight"
    path = copy_fixture(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name}.*\[32, 16\]"):
        Model.from_hf(path)


def test_misshaped_tensor(tmp_path):
    name = "model.layers.3.attention.kv_b_proj.weight"

    def edit(t):
        t[name] = np.zeros((64, 11), np.float32)

    with pytest.raises(CheckpointError) as e:
        Model.from_hf(copy_fixture(tmp_path, edit))
    assert str(e.value) == f"tensor {name!r} has shape [64, 11], expected [64, 12]"


def test_truncated_file(tmp_path):
    path = copy_fixture(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        Model.from_hf(path)
    (path / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        Model.from_hf(path)


def test_corrupt_header(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="corrupt"):
        SafetensorsFile(path)


def test_unknown_dtype(tmp_path):
    write_raw(tmp_path / "m.safetensors", {"x": ("F8_E4M3", [4], b"\0" * 4)})
    with pytest.raises(CheckpointError, match=r"'x'.*unsupported dtype 'F8_E4M3'"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_offsets_must_match_shape(tmp_path):
    write_raw(tmp_path / "m.safetensors", {"x": ("F32", [4], b"\0" * 12)})
    with pytest.raises(CheckpointError, match="'x'"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_sharded_checkpoint_with_index(tmp_path):
    tensors = load_file(F32_FIXTURE / "model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(F32_FIXTURE / "config.json", out)
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = np.arange(2, 40)
    expect = Model.from_hf(F32_FIXTURE)
    got = Model.from_hf(out)
    np.testing.assert_array_equal(
        got.forward(ids, got.new_state()), expect.forward(ids, expect.new_state())
    )
    (out / "b.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"b\.safetensors"):
        Model.from_hf(out)


def test_no_safetensors(tmp_path):
    shutil.copy(F32_FIXTURE / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Model.from_hf(tmp_path)


def test_canonical_names():
    assert canonical_name("model.embed_tokens.weight") == "model.word_embeddings.weight"
    assert (
        canonical_name("model.layers.2.self_attn.forget_gate.A_log")
        == "model.layers.2.attention.A_log"
    )
    assert (
        canonical_name("model.layers.1.mlp.gate.e_score_correction_bias")
        == "model.layers.1.mlp.gate.expert_bias"
    )
    assert canonical_name("lm_head.weight") == "lm_head.weight"


def test_same_tensor_under_two_spellings_is_an_error(tmp_path):
    def edit(t):
        t["model.embed_tokens.weight"] = t["model.word_embeddings.weight"]

    with pytest.raises(CheckpointError, match="stored twice"):
        Model.from_hf(copy_fixture(tmp_path, edit))


def test_empty_tensor(tmp_path):
    write_raw(tmp_path / "m.safetensors", {"x": ("F32", [0, 4], b"")})
    assert SafetensorsFile(tmp_path / "m.safetensors").float32("x").shape == (0, 4)


def test_loading_reads_no_routed_expert_and_no_whole_embedding(monkeypatch):
    """Dense weights are read at load; experts and the embedding table only on use, and then
    only the routed experts / looked-up rows are widened from bf16."""
    whole: list[str] = []
    rows: list[str] = []
    float32, float32_rows = SafetensorsFile.float32, SafetensorsFile.float32_rows

    def spy_whole(self, name):
        whole.append(name)
        return float32(self, name)

    def spy_rows(self, name, ids):
        rows.append(name)
        return float32_rows(self, name, ids)

    monkeypatch.setattr(SafetensorsFile, "float32", spy_whole)
    monkeypatch.setattr(SafetensorsFile, "float32_rows", spy_rows)
    model = Model.from_hf(ORACLE_DIR / "lora_hfmodule_bf16")  # merged experts, bf16
    assert whole and not [n for n in whole if ".experts." in n or "embed" in n]
    assert not rows
    whole.clear()
    model.forward([5], model.new_state())
    assert not whole
    routed = [n for n in rows if ".experts." in n]
    # one gate_up + one down per routed expert per MoE layer, nothing else
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
    assert len(routed) == 2 * model.config.num_experts_per_tok * moe_layers
    assert "model.embed_tokens.weight" in rows


def test_tied_embeddings(tmp_path):
    def edit(t):
        t["lm_head.weight"] = t["model.word_embeddings.weight"].copy()

    untied = copy_fixture(tmp_path / "a", edit)
    tied = copy_fixture(tmp_path / "b", lambda t: t.pop("lm_head.weight"))
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    ids = np.arange(3, 30)
    a, b = Model.from_hf(untied), Model.from_hf(tied)
    np.testing.assert_array_equal(a.forward(ids, a.new_state()), b.forward(ids, b.new_state()))

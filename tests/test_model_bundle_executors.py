"""Executors opened from a bundle: stage graphs through the plan's runtime and cores,
routed experts through the manifest's format, QMoE weights read from the bundle's
safetensors via ONNX external data."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.numpy import save_file

from convert.experts_quant import dequantize_experts, quantize_experts
from convert.onnx_ops import GraphBuilder, np_rmsnorm
from convert.qmoe_graph import write_qmoe_layer
from ling3_rknn.bundle import Bundle, BundleWriter, FileCorruptError
from ling3_rknn.model import FloatExperts
from ling3_rknn.model.bundle_executors import open_experts, open_stage
from ling3_rknn.npu import (
    ExpertError,
    MockRKNNLite,
    NpuError,
    OnnxExecutor,
    QMoeExperts,
    RknnLiteExecutor,
)

D, E, INTER, K = 64, 8, 32, 2


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return {
        "norm": rng.normal(1, 0.1, D).astype(np.float32),
        "proj": rng.normal(0, 0.2, (48, D)).astype(np.float32),
        "experts": tuple(rng.normal(0, 0.1, s).astype(np.float32)
                         for s in ((E, INTER, D), (E, INTER, D), (E, D, INTER))),
    }


def make_bundle(root: Path, weights, target="rk3588", experts="int4") -> Path:
    with BundleWriter(root) as w:
        w.write_bytes("tokenizer.json", b"{}")
        save_file({"embed": np.zeros((4, D), np.float32)}, str(w.path("weights.safetensors")))
        b = GraphBuilder("layer.0.in")
        x = b.input("hidden", [1, "T", D])
        b.output(b.linear(b.rmsnorm(x, weights["norm"], 1e-6, "n"), weights["proj"], "p"), "q")
        onnx.save(b.build(), str(w.path("stages/layer.0.in.onnx")))
        if target == "rk3588":
            w.write_bytes("stages/layer.0.in.rknn", b"stand-in: the mock runs the twin")
        layer = {"weights": "experts/layer.1.safetensors"}
        if experts == "fp16":
            g, u, d = (a.astype(np.float16) for a in weights["experts"])
            save_file({"gate": g, "up": u, "down": d}, str(w.path(layer["weights"])))
        else:
            packed = quantize_experts(*weights["experts"], bits=4 if experts == "int4" else 8)
            save_file(packed.tensors(), str(w.path(layer["weights"])))
            write_qmoe_layer(packed, w.path(layer["weights"]), w.path("experts/layer.1.onnx"), K)
            layer["onnx"] = "experts/layer.1.onnx"
        return w.commit({
            "target": target, "model_config": {"hidden_size": D}, "generation_config": {},
            "chunk_sizes": [1, 4],
            "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(b"{}").hexdigest()},
            "chat_template": None, "weights": "weights.safetensors",
            "stages": {"layer.0.in": {
                "onnx": "stages/layer.0.in.onnx",
                "rknn": "stages/layer.0.in.rknn" if target == "rk3588" else None,
                "quant": "fp16" if target == "rk3588" else "fp32",
                "inputs": ["hidden"], "outputs": ["q"],
                "shape_sets": [[[1, 1, D]], [[1, 4, D]]], "input_dtype": "float32",
                "nbytes": 0}},
            "experts": {"format": experts, "block_size": 32, "top_k": K,
                        "layers": {"1": layer}},
            "placement": {"stage_cores": {"layer.0.in": "2"}, "npu_experts": {},
                          "npu_budget_bytes": None},
        })


@pytest.fixture(scope="module")
def rk_bundle(tmp_path_factory, weights):
    return make_bundle(tmp_path_factory.mktemp("b") / "rk", weights)


def routing(t, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.array([rng.choice(E, K, replace=False) for _ in range(t)], np.int64)
    return rng.normal(size=(t, D)).astype(np.float32), ids, rng.random((t, K)).astype(np.float32)


def test_stage_runs_through_rknnlite_with_the_planned_core(rk_bundle, weights):
    bundle = Bundle.open(rk_bundle, verify="full")
    ex = open_stage(bundle, "layer.0.in", runtime="mock")
    assert isinstance(ex, RknnLiteExecutor) and ex.core_mask == MockRKNNLite.NPU_CORE_2
    x = np.random.default_rng(1).normal(size=(1, 4, D)).astype(np.float32)
    (q,) = ex.run(x)
    np.testing.assert_allclose(q, np_rmsnorm(x, weights["norm"], 1e-6) @ weights["proj"].T,
                               rtol=1e-5, atol=1e-5)
    assert isinstance(open_stage(bundle, "layer.0.in", runtime="onnx"), OnnxExecutor)


def test_replanning_the_cores_needs_no_code(rk_bundle):
    bundle = Bundle.open(rk_bundle)
    plan = replace(bundle.manifest.placement, stage_cores={"layer.0.in": "0_1_2"})
    replanned = replace(bundle, manifest=replace(bundle.manifest, placement=plan))
    assert open_stage(replanned, "layer.0.in", rknnlite_cls=MockRKNNLite).core_mask == 7


def test_cpu_bundle_runs_the_onnx_twin(tmp_path, weights):
    bundle = Bundle.open(make_bundle(tmp_path / "cpu", weights, target="cpu"))
    assert isinstance(open_stage(bundle, "layer.0.in"), OnnxExecutor)


def test_unknown_stage(rk_bundle):
    with pytest.raises(NpuError, match="no stage"):
        open_stage(Bundle.open(rk_bundle), "layer.9.out")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_qmoe_experts_from_the_bundle(tmp_path, weights, fmt):
    bundle = Bundle.open(make_bundle(tmp_path / fmt, weights, experts=fmt), verify="full")
    ex = open_experts(bundle, 1)
    assert isinstance(ex, QMoeExperts) and ex.num_experts == E and ex.top_k == K
    packed = quantize_experts(*weights["experts"], bits=4 if fmt == "int4" else 8)
    ref = FloatExperts(*dequantize_experts(packed), top_k=K)
    x, ids, w = routing(5)
    got, want = ex.run(x, ids, w), ref.run(x, ids, w)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2.5e-2


def test_fp16_experts_from_the_bundle(tmp_path, weights):
    bundle = Bundle.open(make_bundle(tmp_path / "f16", weights, experts="fp16"))
    ex = open_experts(bundle, 1)
    assert isinstance(ex, FloatExperts)
    x, ids, w = routing(3)
    ref = FloatExperts(*weights["experts"], top_k=K).run(x, ids, w)
    np.testing.assert_allclose(ex.run(x, ids, w), ref, atol=2e-3)


def test_expert_format_mismatch_and_missing_layer(tmp_path, weights):
    bundle = Bundle.open(make_bundle(tmp_path / "i4", weights, experts="int4"))
    lying = replace(bundle, manifest=replace(
        bundle.manifest, experts=replace(bundle.manifest.experts, format="int8")))
    with pytest.raises(ExpertError, match="is not int8"):
        open_experts(lying, 1)
    with pytest.raises(ExpertError, match="layer 2"):
        open_experts(bundle, 2)


def test_corrupt_expert_weights_are_caught_before_use(tmp_path, weights):
    root = make_bundle(tmp_path / "c", weights)
    path = root / "experts" / "layer.1.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(FileCorruptError, match=r"layer\.1\.safetensors"):
        Bundle.open(root, verify="full")


def test_a_graph_off_the_stage_contract_is_refused_at_load():
    """Outputs are read by position, so a graph whose names differ from the stage
    contract (``model/stage_contract.py``) is a BundleError when the stages are built."""
    from types import SimpleNamespace

    from conftest import ORACLE_DIR

    from ling3_rknn.bundle import BundleError, StageName
    from ling3_rknn.config import ModelConfig
    from ling3_rknn.model.bundle_stages import check_contract
    from ling3_rknn.model.stage_contract import stage_contract

    cfg = ModelConfig.from_file(ORACLE_DIR / "lora_hfsave" / "config.json")
    for name in ("layer.0.in", "layer.0.out", "layer.1.out", "final"):
        contract = stage_contract(cfg, StageName.parse(name))
        ok = SimpleNamespace(spec=SimpleNamespace(inputs=contract.input_names,
                                                  outputs=contract.output_names))
        check_contract(cfg, name, ok)
        names = contract.output_names
        for outputs in (names[::-1], (*names[:-1], "renamed")):
            if outputs == names:
                continue
            off = SimpleNamespace(spec=SimpleNamespace(inputs=contract.input_names,
                                                       outputs=outputs))
            with pytest.raises(BundleError, match="stage contract"):
                check_contract(cfg, name, off)
    with pytest.raises(BundleError, match="not a stage name"):
        check_contract(cfg, "layer0.in", ok)


def test_the_plan_names_exactly_the_runtime_core_masks():
    """The manifest's core-mask names (bundle format) and the masks the executors accept
    (npu) are spelled in two sibling packages; the model joins them, so they must agree."""
    from ling3_rknn.bundle import CORE_MASK_NAMES
    from ling3_rknn.npu import CORE_MASKS

    assert tuple(CORE_MASKS) == CORE_MASK_NAMES

"""RknnLiteExecutor on the RKNNLite mock (the board code path on the host), the mock's
RKNNLite-compatible behaviour, and the plain OnnxExecutor."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from convert.onnx_ops import GraphBuilder, np_rmsnorm
from ling3_rknn.bundle import StageSpec
from ling3_rknn.npu import (
    MockRKNNLite,
    NpuError,
    NpuInputError,
    OnnxExecutor,
    RknnLiteExecutor,
    resolve_rknnlite,
)
from ling3_rknn.npu.executors import LIBRKNNRT, runtime_problem

D, P, H = 32, 48, 4


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return {
        "norm": rng.normal(1, 0.1, D).astype(np.float32),
        "q": rng.normal(0, 0.2, (P, D)).astype(np.float32),
        "g": rng.normal(0, 0.2, (H, D)).astype(np.float32),
    }


def reference(x, w):
    u = np_rmsnorm(x, w["norm"], 1e-6)
    return u @ w["q"].T, 1 / (1 + np.exp(-(u @ w["g"].T)))


@pytest.fixture
def stage(tmp_path, weights):
    """An attention-input-like stage (RMSNorm -> projection + sigmoid gate) whose ONNX
    twin has a symbolic T, with a stand-in .rknn next to it (the mock only reads it)."""
    b = GraphBuilder("in_stage")
    x = b.input("hidden", [1, "T", D])
    u = b.rmsnorm(x, weights["norm"], 1e-6, "norm")
    b.output(b.linear(u, weights["q"], "q"), "q", [1, "T", P])
    b.output(b.sigmoid(b.linear(u, weights["g"], "g")), "gate", [1, "T", H])
    onnx.save(b.build(), str(tmp_path / "layer0.in.onnx"))
    (tmp_path / "layer0.in.rknn").write_bytes(b"RKNN stand-in")
    spec = StageSpec(name="layer0.in", onnx="layer0.in.onnx", rknn="layer0.in.rknn",
                     quant="fp16", inputs=("hidden",), outputs=("q", "gate"),
                     shape_sets=(((1, 1, D),), ((1, 4, D),)))
    return tmp_path, spec


@pytest.mark.parametrize("t", [1, 4])
def test_rknnlite_executor_on_mock_matches_numpy(stage, weights, t):
    root, spec = stage
    ex = RknnLiteExecutor(root / spec.rknn, spec, core_mask="1", rknnlite_cls=MockRKNNLite)
    assert ex._lite.core_mask == MockRKNNLite.NPU_CORE_1
    x = np.random.default_rng(t).normal(size=(1, t, D)).astype(np.float32)
    q, gate = ex.run(x)
    rq, rg = reference(x, weights)
    np.testing.assert_allclose(q, rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate, rg, rtol=1e-5, atol=1e-6)
    assert q.dtype == np.float32
    ex.close()


def test_onnx_executor_gives_the_same_numbers(stage):
    root, spec = stage
    x = np.random.default_rng(2).normal(size=(1, 4, D)).astype(np.float32)
    a = RknnLiteExecutor(root / spec.rknn, spec, rknnlite_cls=MockRKNNLite).run(x)
    b = OnnxExecutor(root / spec.onnx, spec).run(x)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


def test_fp16_fed_stage_stays_close(stage, weights):
    root, spec = stage
    from dataclasses import replace

    ex = RknnLiteExecutor(root / spec.rknn, replace(spec, input_dtype="float16"),
                          rknnlite_cls=MockRKNNLite)
    x = np.random.default_rng(3).normal(size=(1, 1, D)).astype(np.float32)
    q, _ = ex.run(x)
    np.testing.assert_allclose(q, reference(x, weights)[0], atol=5e-3)


@pytest.mark.parametrize("inputs,match", [
    (lambda x: (), "takes 1 inputs"),
    (lambda x: (x, x), "takes 1 inputs"),
    (lambda x: (x[:, :1, :-1],), "input shapes"),
    (lambda x: (np.concatenate([x, x[:, :1]], 1),), "built for"),  # T=5: not a built shape
    (lambda x: (x.astype(np.int32),), "float numpy array"),
    (lambda x: (x.tolist(),), "float numpy array"),
])
def test_bad_inputs_are_typed_errors(stage, inputs, match):
    root, spec = stage
    x = np.zeros((1, 4, D), np.float32)
    for ex in (RknnLiteExecutor(root / spec.rknn, spec, rknnlite_cls=MockRKNNLite),
               OnnxExecutor(root / spec.onnx, spec)):
        with pytest.raises(NpuInputError, match=match):
            ex.run(*inputs(x))


def test_load_and_init_failures_are_npu_errors(stage):
    root, spec = stage
    with pytest.raises(NpuError, match="load_rknn"):
        RknnLiteExecutor(root / "missing.rknn", spec, rknnlite_cls=MockRKNNLite)
    (root / spec.onnx).rename(root / "elsewhere.onnx")
    with pytest.raises(NpuError, match="init_runtime"):
        RknnLiteExecutor(root / spec.rknn, spec, rknnlite_cls=MockRKNNLite)


def test_core_masks(stage):
    root, spec = stage
    with pytest.raises(NpuError, match="unknown core mask"):
        RknnLiteExecutor(root / spec.rknn, spec, core_mask="3", rknnlite_cls=MockRKNNLite)
    with pytest.raises(NpuError, match="init_runtime"):  # the runtime itself refuses 5
        RknnLiteExecutor(root / spec.rknn, spec, core_mask=5, rknnlite_cls=MockRKNNLite)
    ex = RknnLiteExecutor(root / spec.rknn, spec, core_mask="0_1_2", rknnlite_cls=MockRKNNLite)
    assert ex.core_mask == 7


def test_runtime_failure_during_inference_is_an_npu_error(stage):
    """The manifest allows a shape the compiled graph does not: the runtime logs and
    returns None, the executor raises."""
    root, spec = stage
    from dataclasses import replace

    b = GraphBuilder("fixed")
    b.output(b.sigmoid(b.input("hidden", [1, 1, D])), "q")
    b.output(b.sigmoid("hidden"), "gate")
    onnx.save(b.build(), str(root / spec.onnx))
    ex = RknnLiteExecutor(root / spec.rknn, spec, rknnlite_cls=MockRKNNLite)
    with pytest.raises(NpuError, match=r"inference on layer0\.in\.rknn failed"):
        ex.run(np.zeros((1, 4, D), np.float32))
    one_output = replace(spec, outputs=("q",))
    ex = RknnLiteExecutor(root / spec.rknn, one_output, rknnlite_cls=MockRKNNLite)
    with pytest.raises(NpuError, match="returned 2 outputs"):
        ex.run(np.zeros((1, 1, D), np.float32))
    with pytest.raises(NpuError, match="manifest declares"):
        OnnxExecutor(root / spec.onnx, one_output)


def test_mock_follows_rknnlite_return_conventions(stage, tmp_path):
    root, spec = stage
    lite = MockRKNNLite()
    assert lite.init_runtime() == -1  # before load_rknn
    assert lite.inference(inputs=[np.zeros((1, 1, D), np.float32)]) is None
    assert lite.load_rknn(str(root / "nope.rknn")) == -1
    assert lite.load_rknn(str(root / spec.rknn)) == 0
    assert lite.init_runtime(target="rk3588") == -1  # no device reachable from the host
    assert lite.init_runtime(core_mask=MockRKNNLite.NPU_CORE_0_1_2) == 0
    assert lite.get_sdk_version()
    x = np.ones((1, 1, D), np.float32)
    out = lite.inference(inputs=[x], get_frame_id=True)
    assert len(out) == 3 and out[2] == 0
    assert lite.inference(inputs=[x, x]) is None  # wrong count: logged, None
    lite.release()
    assert lite.inference(inputs=[x]) is None


def test_mock_reads_4d_inputs_as_nhwc_unless_told(tmp_path):
    b = GraphBuilder("four_d")
    b.output(b.sigmoid(b.input("x", [1, 2, 3, 5])), "y")
    onnx.save(b.build(), str(tmp_path / "g.onnx"))
    (tmp_path / "g.rknn").write_bytes(b"x")
    lite = MockRKNNLite()
    lite.load_rknn(str(tmp_path / "g.rknn"))
    lite.init_runtime()
    nchw = np.random.default_rng(0).normal(size=(1, 2, 3, 5)).astype(np.float32)
    assert lite.inference(inputs=[nchw]) is None  # the real runtime's classic gotcha
    (y,) = lite.inference(inputs=[nchw], data_format=["nchw"])
    (y2,) = lite.inference(inputs=[nchw.transpose(0, 2, 3, 1)])  # NHWC data, default format
    np.testing.assert_array_equal(y, y2)


def test_mock_counts_inference_calls(stage):
    root, spec = stage
    MockRKNNLite.reset_stats()
    ex = RknnLiteExecutor(root / spec.rknn, spec, rknnlite_cls=MockRKNNLite)
    for _ in range(3):
        ex.run(np.zeros((1, 1, D), np.float32))
    assert MockRKNNLite.stats["inference"] == 3
    assert MockRKNNLite.stats["inference:layer0.in.rknn"] == 3


def test_resolve_rknnlite(monkeypatch):
    monkeypatch.delenv("LING3_NPU_RUNTIME", raising=False)
    assert resolve_rknnlite("mock") is MockRKNNLite
    assert resolve_rknnlite() is MockRKNNLite  # no rknnlite on the host: auto -> mock
    with pytest.raises(NpuError, match="rknn-toolkit-lite2 is not installed"):
        resolve_rknnlite("board")
    with pytest.raises(NpuError, match="unknown NPU runtime"):
        resolve_rknnlite("gpu")
    monkeypatch.setenv("LING3_NPU_RUNTIME", "board")
    with pytest.raises(NpuError):
        resolve_rknnlite()
    assert resolve_rknnlite("mock") is MockRKNNLite  # the explicit choice wins


def test_executor_resolves_the_runtime_from_the_environment(stage, monkeypatch):
    root, spec = stage
    monkeypatch.setenv("LING3_NPU_RUNTIME", "mock")
    assert RknnLiteExecutor(root / spec.rknn, spec).runtime_name == "MockRKNNLite"


def test_board_runtime_class_is_used_when_importable(stage, monkeypatch):
    """On the board ``rknnlite.api.RKNNLite`` is picked up; simulate the module."""
    import sys
    import types

    class BoardRKNNLite(MockRKNNLite):
        pass

    api = types.ModuleType("rknnlite.api")
    api.RKNNLite = BoardRKNNLite
    pkg = types.ModuleType("rknnlite")
    pkg.api = api
    monkeypatch.setitem(sys.modules, "rknnlite", pkg)
    monkeypatch.setitem(sys.modules, "rknnlite.api", api)
    monkeypatch.delenv("LING3_NPU_RUNTIME", raising=False)
    assert resolve_rknnlite() is BoardRKNNLite
    root, spec = stage
    assert RknnLiteExecutor(root / spec.rknn, spec).runtime_name == "BoardRKNNLite"


def test_a_real_runtime_that_cannot_start_says_why(stage, tmp_path):
    """RKNNLite only logs its failure; the error names the missing librknnrt.so or the
    machine that is not an RK3588, the way doctor does."""
    class BoardRKNNLite(MockRKNNLite):
        def init_runtime(self, core_mask=0):
            return -1

    root, spec = stage
    lib, dt = tmp_path / "librknnrt.so", tmp_path / "compatible"
    problem = runtime_problem(BoardRKNNLite, lib, dt)
    assert f"{lib} is missing" in problem and "/usr/lib" in problem
    lib.write_bytes(b"\x7fELF")
    dt.write_bytes(b"raspberrypi,5-model-b\0brcm,bcm2712\0")
    assert "not an RK3588" in runtime_problem(BoardRKNNLite, lib, dt)
    dt.write_bytes(b"friendlyelec,cm3588\0rockchip,rk3588\0")
    assert runtime_problem(BoardRKNNLite, lib, dt) == "see the RKNNLite log above"
    assert runtime_problem(MockRKNNLite, tmp_path / "none", dt) == "see the log above"
    if not LIBRKNNRT.exists():
        with pytest.raises(NpuError, match=r"librknnrt\.so is missing"):
            RknnLiteExecutor(root / spec.rknn, spec, rknnlite_cls=BoardRKNNLite)

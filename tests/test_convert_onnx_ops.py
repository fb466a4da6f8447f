"""The ONNX stage-op helpers against their numpy twins, run through onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from convert.onnx_ops import GraphBuilder, np_rmsnorm, np_silu, np_swiglu_mlp


def run(model, **feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("t", [1, 5])
def test_rmsnorm_matches_numpy(rng, t):
    d = 48
    w = rng.normal(1, 0.2, d).astype(np.float32)
    x = (rng.normal(size=(1, t, d)) * 3).astype(np.float32)
    b = GraphBuilder("norm")
    b.output(b.rmsnorm(b.input("x", [1, t, d]), w, 1e-6, "n"), "y", [1, t, d])
    (y,) = run(b.build(), x=x)
    np.testing.assert_allclose(y, np_rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_linear_uses_hf_weight_layout_and_bias(rng):
    w = rng.normal(size=(24, 16)).astype(np.float32)  # [out, in]
    bias = rng.normal(size=24).astype(np.float32)
    x = rng.normal(size=(1, 3, 16)).astype(np.float32)
    b = GraphBuilder("lin")
    b.output(b.linear(b.input("x", [1, 3, 16]), w, "p", bias=bias), "y")
    model = b.build()
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 24]  # inferred, the manifest and rknn need static output shapes
    (y,) = run(model, x=x)
    np.testing.assert_allclose(y, x @ w.T + bias, rtol=1e-5, atol=1e-5)


def test_swiglu_mlp_and_residual(rng):
    d, f = 32, 80
    g, u = (rng.normal(0, 0.2, (f, d)).astype(np.float32) for _ in range(2))
    dn = rng.normal(0, 0.2, (d, f)).astype(np.float32)
    x = rng.normal(size=(1, 4, d)).astype(np.float32)
    b = GraphBuilder("mlp")
    xi = b.input("x", [1, 4, d])
    b.output(b.add(xi, b.swiglu_mlp(xi, g, u, dn, "mlp")), "y")
    (y,) = run(b.build(), x=x)
    np.testing.assert_allclose(y, x + np_swiglu_mlp(x, g, u, dn), rtol=1e-5, atol=1e-5)


def test_sigmoid_gate_scale_shift_and_several_outputs(rng):
    d, h = 16, 4
    wg = rng.normal(size=(h, d)).astype(np.float32)
    scale = rng.random(h).astype(np.float32) + 0.5
    shift = rng.normal(size=h).astype(np.float32)
    x = rng.normal(size=(1, 2, d)).astype(np.float32)
    b = GraphBuilder("gate")
    xi = b.input("x", [1, 2, d])
    proj = b.linear(xi, wg, "g")
    b.output(b.sigmoid(b.scale_shift(proj, "gs", scale, shift)), "gate")
    b.output(b.silu(proj), "act")
    gate, act = run(b.build(), x=x)
    z = x @ wg.T
    np.testing.assert_allclose(gate, 1 / (1 + np.exp(-(z * scale + shift))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(act, np_silu(z), rtol=1e-5, atol=1e-6)


def test_fp16_weights_are_stored_as_fp16(rng):
    b = GraphBuilder("half", weight_dtype=np.float16)
    b.weight("w", rng.normal(size=(4, 4)))
    b.input("x", [1, 1, 4])
    b.output("x", "y")
    model = b.build()
    assert model.graph.initializer[0].data_type == 10  # TensorProto.FLOAT16


def test_duplicate_names_are_rejected(rng):
    b = GraphBuilder("dup")
    b.input("x", [1, 1, 4])
    with pytest.raises(ValueError, match="duplicate"):
        b.constant("x", np.zeros(1, np.float32))


def test_graphs_stay_readable_by_rknn_toolkit_onnx(rng):
    """onnx<=1.18 in .venv-rknn reads IR <= 10; opset 17 keeps ReduceMean's axes attribute."""
    b = GraphBuilder("ir")
    b.output(b.rmsnorm(b.input("x", [1, 1, 8]), np.ones(8), 1e-6, "n"), "y")
    model = b.build()
    assert model.ir_version == 8
    assert model.opset_import[0].version == 17


def test_consumed_elementwise_outputs_are_cloned_not_aliased(rng):
    """rknn-toolkit2 2.5.0 crashes under dynamic_input when a residual Add is both a graph
    output and consumed further; the builder recomputes such outputs with a clone."""
    w = rng.normal(size=(8, 8)).astype(np.float32)
    b = GraphBuilder("residual")
    x = b.input("x", [1, "T", 8])
    h = b.add(x, b.linear(x, w, "o"))
    b.output(h, "h")
    b.output(b.rmsnorm(h, np.ones(8), 1e-6, "n"), "u")
    model = b.build()
    producers = {o: n for n in model.graph.node for o in n.output}
    assert producers["h"].op_type == "Add"  # the clone, not an Identity of the shared Add
    assert not any(n.op_type == "Identity" for n in model.graph.node)
    xv = rng.normal(size=(1, 3, 8)).astype(np.float32)
    hv, uv = run(model, x=xv)
    np.testing.assert_allclose(hv, xv + xv @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(uv, np_rmsnorm(hv, np.ones(8), 1e-6), rtol=1e-5, atol=1e-5)

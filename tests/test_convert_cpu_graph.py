"""convert/cpu_graph.py: the --target cpu stage graphs merged into fewer nodes compute what
the unmerged graphs compute, with the same inputs and outputs in the same order."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest

from convert.cpu_quant import quantize_matmuls
from convert.onnx_ops import GraphBuilder


def stage_like_graph(path, rng, d=64):
    """RMSNorm -> four projections of one input (one output cloned, one through an
    Identity) -> a second RMSNorm on one of them -> a projection of that: the shapes of
    an MLA input stage in small."""
    b = GraphBuilder("stage", external_data=path.with_name(path.name + ".data"))
    x = b.input("x", [1, "T", d])
    h = b.rmsnorm(x, rng.normal(1, 0.1, d).astype(np.float32), 1e-6, "norm")
    w = {n: (rng.normal(size=(o, d)) / d ** 0.5).astype(np.float32)
         for n, o in (("a", 96), ("b", 32), ("c", 64), ("g", 8))}
    a = b.linear(h, w["a"], "a")
    a_n = b.rmsnorm(a, rng.normal(1, 0.1, 96).astype(np.float32), 1e-5, "a_norm")
    b.output(b.linear(a_n, (rng.normal(size=(48, 96)) / 96 ** 0.5).astype(np.float32), "q"),
             "q")
    b.output(b.linear(h, w["b"], "b"), "kv")
    b.output(b.mul(b.linear(h, w["c"], "c"), b.constant("two", np.float32(2.0))), "c2")
    b.output(b.sigmoid(b.linear(h, w["g"], "g")), "gate")
    b.output(a_n, "a_normed")  # a clone of the norm's last Mul
    model = b.build()
    import onnx

    onnx.save(model, str(path))
    return path


def run(model, x):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return sess, sess.run(None, {"x": x})


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("t", [1, 7])
def test_fused_graph_matches_unfused(tmp_path, bits, t):
    rng = np.random.default_rng(3)
    src = stage_like_graph(tmp_path / "stage.onnx", rng)
    # accuracy level 0 (float activations): the merge itself is exact, so only the fused
    # RMSNorm's float32 rounding may differ
    kw = dict(bits=bits, block_size=32, accuracy_level=0)
    plain = quantize_matmuls(src, fuse=False, **kw)
    fused = quantize_matmuls(src, **kw)
    x = rng.normal(size=(1, t, 64)).astype(np.float32) * 3
    s0, want = run(plain, x)
    s1, got = run(fused, x)
    assert [o.name for o in s1.get_outputs()] == [o.name for o in s0.get_outputs()]
    assert [i.name for i in s1.get_inputs()] == ["x"]
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)

    before = Counter(n.op_type for n in plain.graph.node)
    after = Counter(n.op_type for n in fused.graph.node)
    assert before["MatMulNBits"] == 5 and after["MatMulNBits"] == 2  # h -> a|b|c|g, a_n -> q
    assert after["SimplifiedLayerNormalization"] == 2
    assert not {"ReduceMean", "Sqrt", "Div", "Identity"} & set(after)
    assert sum(after.values()) < sum(before.values()) // 2


def test_accuracy_level_4_stays_within_activation_rounding(tmp_path):
    """At level 4 the activations are quantized to int8 per block; the fused RMSNorm's
    last-bit differences can move a rounding edge, nothing more."""
    rng = np.random.default_rng(4)
    src = stage_like_graph(tmp_path / "stage.onnx", rng)
    kw = dict(bits=8, block_size=32, accuracy_level=4)
    x = rng.normal(size=(1, 16, 64)).astype(np.float32)
    _, want = run(quantize_matmuls(src, fuse=False, **kw), x)
    _, got = run(quantize_matmuls(src, **kw), x)
    for w, g in zip(want, got, strict=True):
        assert np.abs(g - w).max() <= 1e-2 * np.abs(w).max()


def test_a_row_split_lm_head_becomes_one_matmul(tmp_path):
    """The final stage writes the lm_head as row blocks joined by a Concat (NPU size
    limits); merged, the Split/Concat pair undoes itself and goes."""
    import onnx

    rng = np.random.default_rng(5)
    d, rows = 64, (48, 48, 32)
    b = GraphBuilder("final", external_data=tmp_path / "final.onnx.data")
    h = b.rmsnorm(b.input("x", [1, "T", d]), rng.normal(1, 0.1, d).astype(np.float32), 1e-6,
                  "norm")
    parts = [b.linear(h, (rng.normal(size=(n, d)) / d ** 0.5).astype(np.float32), f"head{i}")
             for i, n in enumerate(rows)]
    b.output(b.node("Concat", parts, "logits", axis=-1), "logits")
    onnx.save(b.build(), str(tmp_path / "final.onnx"))
    kw = dict(bits=8, block_size=32, accuracy_level=0)
    plain = quantize_matmuls(tmp_path / "final.onnx", fuse=False, **kw)
    fused = quantize_matmuls(tmp_path / "final.onnx", **kw)
    assert [n.op_type for n in fused.graph.node] == ["SimplifiedLayerNormalization",
                                                     "MatMulNBits"]
    x = rng.normal(size=(1, 3, d)).astype(np.float32)
    (want,), (got,) = run(plain, x)[1], run(fused, x)[1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

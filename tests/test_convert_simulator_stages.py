"""Simulator tier: stage-like graphs built with rknn-toolkit2 for rk3588 and run in its
x86 simulator, compared with numpy.

The graphs use the op vocabulary of the real stage graphs (RMSNorm -> MatMul projections,
a low-rank projection with a norm in the middle as in MLA, sigmoid gates, constant
scale/shift as in the KDA forget gate, residual + post-norm + SwiGLU shared expert +
router logits, final norm + lm_head) with random weights at reduced width. Each case
records cosine similarity and max abs error per output; w8a8 must keep cosine >= 0.99,
fp16 max abs error <= 1e-2. Set ``LING3_SIM_REPORT=path.json`` to keep the figures.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable

import numpy as np
import onnx
import pytest

from convert.onnx_ops import GraphBuilder, np_rmsnorm, np_swiglu_mlp
from convert.rknn_toolkit import RknnBuildError, build_rknn, rknn_available

pytestmark = [
    pytest.mark.simulator,
    pytest.mark.skipif(not rknn_available(),
                       reason="rknn-toolkit2 env missing: run `make rknn-env`"),
]

D, CHUNK, EPS = 256, 16, 1e-6
RESULTS: list[dict] = []


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def w(rng, *shape, gain=1.0):
    return (rng.normal(size=shape) * gain / np.sqrt(shape[-1])).astype(np.float32)


class Case:
    """A stage graph + its numpy twin over inputs ``[1, T, D]``."""

    def __init__(self, name: str, inputs: list[str],
                 build: Callable[[GraphBuilder, list[str]], dict[str, str]],
                 ref: Callable[..., dict[str, np.ndarray]]) -> None:
        self.name, self.inputs, self.build, self.ref = name, inputs, build, ref

    def model(self) -> onnx.ModelProto:
        b = GraphBuilder(self.name)
        ins = [b.input(n, [1, "T", D]) for n in self.inputs]
        for out_name, value in self.build(b, ins).items():
            b.output(value, out_name)
        return b.build()


def attention_input_case(rng) -> Case:
    norm = rng.normal(1, 0.1, D).astype(np.float32)
    wq = w(rng, 192, D)
    q_a, q_a_norm, q_b = w(rng, 64, D), rng.normal(1, 0.1, 64).astype(np.float32), w(rng, 192, 64)
    kv_lat, kv_norm, k_rope = w(rng, 128, D), rng.normal(1, 0.1, 128).astype(np.float32), \
        w(rng, 32, D)
    wf, dt_bias, a_scale = w(rng, 64, D), rng.normal(0, 0.5, 64).astype(np.float32), \
        np.repeat(np.exp(rng.normal(0, 0.3, 4)), 16).astype(np.float32)
    # 16 heads as in the real model: an output narrower than 8 channels leaves its final
    # Reshape on the board CPU (found with the placement table; the tiny oracle has 4)
    wb, wg = w(rng, 16, D), w(rng, 16, D)

    def build(b, ins):
        u = b.rmsnorm(ins[0], norm, EPS, "input_layernorm")
        qa = b.rmsnorm(b.linear(u, q_a, "q_a_proj"), q_a_norm, EPS, "q_a_layernorm")
        forget = b.scale_shift(b.linear(u, wf, "f_proj"), "forget", a_scale,
                               None)
        return {
            "q": b.linear(u, wq, "q_proj"),
            "q_mla": b.linear(qa, q_b, "q_b_proj"),
            "kv_latent": b.rmsnorm(b.linear(u, kv_lat, "kv_a_latent"), kv_norm, EPS,
                                   "kv_a_layernorm"),
            "k_rope": b.linear(u, k_rope, "kv_a_rope"),
            # lower bound * sigmoid(exp(A_log) * (f + dt_bias)): NPU-friendly, no Exp
            "forget_gate": b.scale_shift(
                b.sigmoid(b.scale_shift(b.add(forget, b.weight("dt", dt_bias * a_scale)),
                                        "fg")), "lb", np.float32(-5.0)),
            "beta": b.sigmoid(b.linear(u, wb, "b_proj")),
            "gate": b.sigmoid(b.linear(u, wg, "g_proj")),
        }

    def ref(x):
        u = np_rmsnorm(x, norm, EPS)
        return {
            "q": u @ wq.T,
            "q_mla": np_rmsnorm(u @ q_a.T, q_a_norm, EPS) @ q_b.T,
            "kv_latent": np_rmsnorm(u @ kv_lat.T, kv_norm, EPS),
            "k_rope": u @ k_rope.T,
            "forget_gate": -5.0 * sigmoid(a_scale * ((u @ wf.T) + dt_bias)),
            "beta": sigmoid(u @ wb.T),
            "gate": sigmoid(u @ wg.T),
        }

    return Case("attention_input", ["hidden"], build, ref)


def attention_output_case(rng) -> Case:
    wo, post = w(rng, D, 192), rng.normal(1, 0.1, D).astype(np.float32)
    sg, su, sd = w(rng, 128, D), w(rng, 128, D), w(rng, D, 128)
    router = w(rng, 16, D)
    # the attention output arrives with width 192 here; pad the input to D with a
    # projection so the case keeps the uniform [1, T, D] input convention
    into = w(rng, 192, D)

    def build(b, ins):
        attn = b.linear(ins[1], into, "attn_in")
        h = b.add(ins[0], b.linear(attn, wo, "o_proj"))
        u = b.rmsnorm(h, post, EPS, "post_attention_layernorm")
        return {"residual": h, "moe_input": u,
                "shared": b.swiglu_mlp(u, sg, su, sd, "shared_experts"),
                "router_logits": b.linear(u, router, "gate")}

    def ref(x, a):
        h = x + (a @ into.T) @ wo.T
        u = np_rmsnorm(h, post, EPS)
        return {"residual": h, "moe_input": u, "shared": np_swiglu_mlp(u, sg, su, sd),
                "router_logits": u @ router.T}

    return Case("attention_output", ["residual_in", "attn"], build, ref)


def dense_ffn_case(rng) -> Case:
    g, u_, d = w(rng, 768, D), w(rng, 768, D), w(rng, D, 768)
    post = rng.normal(1, 0.1, D).astype(np.float32)

    def build(b, ins):
        return {"out": b.add(ins[0], b.swiglu_mlp(b.rmsnorm(ins[0], post, EPS, "post"),
                                                   g, u_, d, "mlp"))}

    def ref(x):
        return {"out": x + np_swiglu_mlp(np_rmsnorm(x, post, EPS), g, u_, d)}

    return Case("dense_ffn", ["hidden"], build, ref)


def lm_head_case(rng) -> Case:
    norm, head = rng.normal(1, 0.1, D).astype(np.float32), w(rng, 2048, D, gain=3.0)

    def build(b, ins):
        return {"logits": b.linear(b.rmsnorm(ins[0], norm, EPS, "norm"), head, "lm_head")}

    def ref(x):
        return {"logits": np_rmsnorm(x, norm, EPS) @ head.T}

    return Case("lm_head", ["hidden"], build, ref)


CASES = {"attention_input": attention_input_case, "attention_output": attention_output_case,
         "dense_ffn": dense_ffn_case, "lm_head": lm_head_case}


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


@pytest.mark.parametrize("quant", ["fp16", "w8a8"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_stage_in_simulator(tmp_path, case_name, quant):
    rng = np.random.default_rng(zlib.crc32(case_name.encode()))
    case = CASES[case_name](rng)
    onnx_path = tmp_path / f"{case.name}.onnx"
    onnx.save(case.model(), str(onnx_path))
    shape_sets = [[[1, 1, D]] * len(case.inputs), [[1, CHUNK, D]] * len(case.inputs)]

    outliers = rng.choice(D, 3, replace=False)  # fixed channels, as in a real residual stream

    def hidden(n, t):  # residual-stream-like activations: unit scale, a few outlier channels
        x = rng.normal(size=(n, 1, t, D)).astype(np.float32)
        x[..., outliers] *= 4
        return x

    # calibration must use the largest shape (docs/toolchain.md 3)
    calib = {n: hidden(8, CHUNK) for n in case.inputs}
    groups = [{n: hidden(3, t) for n in case.inputs} for t in (1, CHUNK)]
    out = tmp_path / f"{case.name}.{quant}.rknn"
    # one .rknn serves decode and prefill: weights are shared between the shape sets
    res = build_rknn(onnx_path, out, quant, calibration=calib, simulate_inputs=groups,
                     dynamic_input=shape_sets)
    assert out.is_file() and out.stat().st_size == res.size_bytes
    assert res.cpu_ops == (), f"ops fell back to the board CPU: {res.cpu_ops}"
    result_rows = []
    for feeds, outputs in zip(groups, res.groups, strict=True):
        for s in range(3):
            refs = case.ref(*(feeds[n][s] for n in case.inputs))
            for name, expected in refs.items():
                got = outputs[name][s]
                assert got.shape == expected.shape, name
                result_rows.append({"case": case.name, "quant": quant, "T": got.shape[1],
                                    "output": name, "cos": cosine(got, expected),
                                    "max_abs": float(np.abs(got - expected).max()),
                                    "ref_max": float(np.abs(expected).max()),
                                    "rknn_bytes": res.size_bytes, "build_s": res.build_seconds})
    RESULTS.extend(result_rows)
    worst = {}
    for r in result_rows:
        key = (r["output"], r["T"])
        if key not in worst or r["cos"] < worst[key]["cos"]:
            worst[key] = r
    lines = [f"  {k[0]:>14} T={k[1]:<3} cos {v['cos']:.6f}  max_abs {v['max_abs']:.2e} "
             f"(|ref| {v['ref_max']:.2f})" for k, v in sorted(worst.items())]
    print(f"\n[simulator] {case.name} {quant}:\n" + "\n".join(lines))
    for r in result_rows:
        if quant == "w8a8":
            assert r["cos"] >= 0.99, r
        else:
            assert r["max_abs"] <= 1e-2 * max(1.0, r["ref_max"] / 4), r
            assert r["cos"] >= 0.9999, r


def test_cpu_fallback_ops_are_reported(tmp_path):
    """Exp has no NPU kernel on rk3588 (docs/toolchain.md 4): the placement table shows it."""
    b = GraphBuilder("exp")
    x = b.input("x", [1, 1, 64])
    e = b._node("Exp", [x], "exp")
    b.output(b.linear(b.rmsnorm(e, np.ones(64), EPS, "n"), np.ones((32, 64)), "p"), "y")
    onnx.save(b.build(), str(tmp_path / "exp.onnx"))
    res = build_rknn(tmp_path / "exp.onnx", tmp_path / "exp.rknn", "fp16")
    assert len(res.cpu_ops) == 1 and res.cpu_ops[0].startswith("Exp:")


def test_toolkit_errors_are_typed_and_leave_no_rknn(tmp_path):
    b = GraphBuilder("tiny")
    b.output(b.sigmoid(b.input("x", [1, 1, 8])), "y")
    onnx.save(b.build(), str(tmp_path / "t.onnx"))
    with pytest.raises(RknnBuildError) as info:
        build_rknn(tmp_path / "t.onnx", tmp_path / "t.rknn", "fp16", target="rk9999")
    assert info.value.step in ("config", "rknn")
    (tmp_path / "bad.onnx").write_bytes(b"garbage")
    with pytest.raises(RknnBuildError):
        build_rknn(tmp_path / "bad.onnx", tmp_path / "bad.rknn", "fp16")
    assert not any(p.suffix == ".rknn" for p in tmp_path.iterdir())


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("LING3_SIM_REPORT")
    if path and RESULTS:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["fp16", "w8a8"])
def test_real_width_output_stage(tmp_path, quant):
    """The attention-output stage at Ling-3.0-tiny's real widths (D=1536, attention 2048,
    shared expert 512, 128 router logits): the w8a8 figures at the size that ships."""
    rng = np.random.default_rng(3)
    d, p, i_s, e = 1536, 2048, 512, 128
    wo, post = w(rng, d, p), rng.normal(1, 0.1, d).astype(np.float32)
    sg, su, sd, router = w(rng, i_s, d), w(rng, i_s, d), w(rng, d, i_s), w(rng, e, d)
    b = GraphBuilder("layer.out")
    x, a = b.input("residual_in", [1, "T", d]), b.input("attn", [1, "T", p])
    h = b.add(x, b.linear(a, wo, "o_proj"))
    u = b.rmsnorm(h, post, EPS, "post_attention_layernorm")
    b.output(h, "residual")
    b.output(b.swiglu_mlp(u, sg, su, sd, "shared_experts"), "shared")
    b.output(b.linear(u, router, "gate"), "router_logits")
    onnx.save(b.build(), str(tmp_path / "out.onnx"))
    outliers = rng.choice(d, 8, replace=False)  # fixed channels, as in a real residual stream

    def sample(n, t):
        xs = rng.normal(size=(n, 1, t, d)).astype(np.float32)
        xs[..., outliers] *= 6
        return {"residual_in": xs, "attn": rng.normal(size=(n, 1, t, p)).astype(np.float32)}

    groups = [sample(2, 1), sample(2, CHUNK)]
    res = build_rknn(tmp_path / "out.onnx", tmp_path / "out.rknn", quant,
                     calibration=sample(8, CHUNK), simulate_inputs=groups,
                     dynamic_input=[[[1, 1, d], [1, 1, p]], [[1, CHUNK, d], [1, CHUNK, p]]])
    assert res.cpu_ops == (), res.cpu_ops
    rows = []
    for feeds, outs in zip(groups, res.groups, strict=True):
        for s in range(2):
            xs, av = feeds["residual_in"][s], feeds["attn"][s]
            hv = xs + av @ wo.T
            uv = np_rmsnorm(hv, post, EPS)
            refs = {"residual": hv, "shared": np_swiglu_mlp(uv, sg, su, sd),
                    "router_logits": uv @ router.T}
            for name, ref in refs.items():
                rows.append((name, ref.shape[1], cosine(outs[name][s], ref),
                             float(np.abs(outs[name][s] - ref).max())))
    print(f"\n[simulator] real-width output stage {quant}: {res.size_bytes} bytes, "
          f"build {res.build_seconds:.1f} s")
    for name, t, cos, err in rows:
        print(f"  {name:>14} T={t:<3} cos {cos:.6f} max_abs {err:.2e}")
        RESULTS.append({"case": "real_width_output", "quant": quant, "T": t, "output": name,
                        "cos": cos, "max_abs": err, "rknn_bytes": res.size_bytes})
        assert cos >= (0.99 if quant == "w8a8" else 0.9999), (name, t, cos)

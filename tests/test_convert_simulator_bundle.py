"""Simulator tier for the real stage graphs of a tiny checkpoint.

Every stage of ``lora_hfsave`` (KDA + MLA with low-rank query, dense FFN, MoE output
stages, final norm + lm_head) is built by rknn-toolkit2 for rk3588 in w8a8 and fp16 from
the converter's own graph builders and calibration set, run in the toolkit's simulator at
T = 1 and T = chunk on held-out calibration-style inputs, and compared with the numpy
stage references. A table of cosine / max error per output is printed and written to
``simulator_stages.json`` under the test's tmp dir (or ``$LING3_SIM_REPORT_BUNDLE``).

Cosine is pooled over all held-out tokens of an output (the worst single token is
reported too). fp16 must keep >= 0.9999 (measured >= 0.999999); w8a8 the issue's 0.99 on
every output, with the converter's defaults (all int8, no auto-hybrid; auto-hybrid at
0.999 gave the same figures) and its levers: 16 calibration prompts x 32 pieces of 16
tokens (the 512 rows a default conversion records) drawn over all prompts, half of them
prompt openings (convert/calibration.py), the KDA ``core`` normalised per head on the
CPU (``stages.kda_core_norm``) and the forget logit clipped to where the gate moves
(``model.stage_contract.FORGET_LOGIT_RANGE``); convert/README.md has the figures before and after
each. ``log_decay`` is compared after the CPU half of the gate, the value the recurrence
uses. Ops the compiler leaves on the
board CPU are recorded, not failed: the tiny model's outputs narrower than 8 channels
(4 heads) hit the Reshape fallback found in phase 1, which the real 16-head model does not.

A second test runs the converter with the real toolkit build and loads the bundle on the
RKNNLite mock, so the ``.rknn`` path of ``convert`` itself is exercised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, ORACLE_DIR

from convert.calibration import calibrate
from convert.converter import ConvertOptions, build_stage, convert, open_checkpoint
from convert.rknn_simulator import SimulatedGraphs, SimulatedStage
from convert.rknn_toolkit import build_rknn, rknn_available
from ling3_rknn.model import Model, NumpyStages
from ling3_rknn.model.stages import kda_normed_output_stage, safe_gate_log_decay

pytestmark = [
    pytest.mark.simulator,
    pytest.mark.skipif(not rknn_available(),
                       reason="rknn-toolkit2 env missing: run `make rknn-env`"),
]

FIXTURE = "lora_hfsave"
CHUNK = 16
MIN_COS = {"w8a8": 0.99, "fp16": 0.9999}
DEFAULTS = ConvertOptions()  # the stage tiers use the converter's defaults (no auto-hybrid)
HYBRID_COS = 0.999  # the auto-hybrid option, exercised by the toolkit conversion test
CALIB_PROMPTS, CALIB_SAMPLES = 16, 32
E2E_POSITIONS = 256
# (stages, experts) -> (min top-1 agreement, max mean KL) vs the float model, 256
# teacher-forced positions. Measured: w8a8 + int4 0.285 / 0.237, w8a8 + fp16 experts
# 0.410 / 0.171, fp16 + fp16 0.949 / 0.0087 (auto-hybrid 0.999: 0.312 / 0.233, 0.434 /
# 0.174). This random 32-wide checkpoint is chaotic:
# the simulator's *fp16* (stage cosine >= 0.99999) already flips 5 % of the top-1
# tokens, and tests/bench/bench_quant_divergence.py shows 1 % relative noise on the float
# model's stage deltas costing 15-25 % top-1. The bounds catch breakage (feeding the KDA
# output stage an unnormalised core: top-1 0.05-0.06, KL 0.71 in all three); a trained
# model is where the figure means accuracy.
E2E_BOUNDS = {("w8a8", "int4"): (0.2, 0.35), ("w8a8", "fp16"): (0.3, 0.3),
              ("fp16", "fp16"): (0.9, 0.02)}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def numpy_outputs(ref: NumpyStages, name: str, feeds: dict[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
    """The numpy stage for ``name`` on ``[T, width]`` inputs, in the graph's output names."""
    if name == "final":
        return {"logits": ref.final(feeds["x"])}
    i = int(name.split(".")[1])
    x = feeds["x"]
    t = x.shape[0]
    if name.endswith(".in"):
        out = ref.kda_input(i, x) if ref._cfg.layer_kinds[i] == "kda" else ref.mla_input(i, x)
        return {k: v.reshape(t, -1) for k, v in vars(out).items()}
    cfg = ref._cfg
    if cfg.layer_kinds[i] == "kda":
        # core_normed is kda_core_norm(core), done on the CPU: not normalised again here
        # (a head whose core is ~0 stays ~0, as in the model)
        core = feeds["core_normed"].reshape(t, cfg.num_attention_heads, cfg.kda_head_dim)
        gate = feeds["out_gate"].reshape(core.shape)
        out = kda_normed_output_stage(x, core, gate, ref._output_weights(i),
                                      eps=cfg.rms_norm_eps)
    else:
        ctx = feeds["ctx"].reshape(t, cfg.num_attention_heads, cfg.kv_lora_rank)
        out = ref.mla_output(i, x, ctx, feeds["gate"])
    if out.moe_input is None:  # dense FFN layer: compare x + attn_delta + ffn_delta
        return {"__dense_hidden__": out.hidden}
    return {"attn_delta": out.hidden - x, "moe_input": out.moe_input, "shared": out.shared,
            "router_logits": out.router_logits}


@pytest.fixture(scope="module")
def setup():
    w = open_checkpoint(ORACLE_DIR / FIXTURE)
    rng = np.random.default_rng(5)
    calib_prompts = [rng.integers(2, 256, 80).tolist() for _ in range(2)]
    held_out = calibrate(w, [rng.integers(2, 256, 64).tolist() for _ in range(2)], CHUNK, 4)
    calib_prompts += [rng.integers(2, 256, 80).tolist() for _ in range(CALIB_PROMPTS - 2)]
    calib = calibrate(w, calib_prompts, CHUNK, CALIB_SAMPLES)
    return w, calib, held_out, NumpyStages(w)


@pytest.mark.parametrize("quant", ["w8a8", "fp16"])
def test_every_stage_in_simulator(setup, quant, tmp_path) -> None:
    w, calib, held_out, ref = setup
    rows, fallbacks = [], {}
    for name in sorted(calib.stage_rows):
        graph = build_stage(w, name, np.float32)
        src = tmp_path / f"{name}.onnx"
        onnx.save(graph.model, str(src))
        samples = held_out.samples(name, graph.inputs, 4)  # [4, 1, CHUNK, width]
        groups = [{k: v[:, :, :1] for k, v in samples.items()}, samples]
        res = build_rknn(src, tmp_path / f"{name}.rknn", quant,
                         calibration=calib.samples(name, graph.inputs, CALIB_SAMPLES)
                         if quant == "w8a8" else None,
                         hybrid_cos=DEFAULTS.w8a8_hybrid_cos,
                         simulate_inputs=groups, dynamic_input=graph.shape_sets((CHUNK,)))
        if res.cpu_ops:
            fallbacks[name] = list(res.cpu_ops)
        for feeds, outs in zip(groups, res.groups, strict=True):
            got_all: dict[str, list[np.ndarray]] = {}
            exp_all: dict[str, list[np.ndarray]] = {}
            for s in range(len(next(iter(feeds.values())))):
                x = {k: v[s, 0] for k, v in feeds.items()}
                expected = numpy_outputs(ref, name, x)
                got = {k: v[s, 0] for k, v in outs.items()}
                if "forget_logit" in got:  # the CPU half of the KDA safe gate
                    got["log_decay"] = safe_gate_log_decay(got.pop("forget_logit"),
                                                           ref._cfg.kda_lower_bound)
                if "__dense_hidden__" in expected:
                    got = {"__dense_hidden__": x["x"] + got["attn_delta"] + got["ffn_delta"]}
                for k, v in expected.items():
                    exp_all.setdefault(k, []).append(v)
                    got_all.setdefault(k, []).append(got[k])
            for out_name, exps in exp_all.items():
                g, e = np.stack(got_all[out_name]), np.stack(exps)
                per_token = [cosine(a, b) for a, b in zip(g.reshape(-1, g.shape[-1]),
                                                          e.reshape(-1, e.shape[-1]),
                                                          strict=True)]
                rows.append({"stage": name, "quant": quant, "T": g.shape[1],
                             "output": out_name, "cos": cosine(g, e),
                             "worst_token_cos": min(per_token),
                             "max_abs": float(np.abs(g - e).max()),
                             "ref_max": float(np.abs(e).max()),
                             "rknn_bytes": res.size_bytes})
    worst: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["stage"], r["output"])
        if key not in worst or r["cos"] < worst[key]["cos"]:
            worst[key] = r
    print(f"\n[simulator] {FIXTURE} stages, {quant} (worst of T=1 / T={CHUNK}):")
    for (stage, out), r in sorted(worst.items()):
        print(f"  {stage:>12} {out:>16} cos {r['cos']:.6f} (worst token "
              f"{r['worst_token_cos']:.4f})  max_abs {r['max_abs']:.2e} (|ref| {r['ref_max']:.2f})")
    for stage, ops in fallbacks.items():
        print(f"  CPU fallback in {stage}: {', '.join(ops)}")
    report = Path(os.environ.get("LING3_SIM_REPORT_BUNDLE") or tmp_path / "simulator_stages.json")
    report.write_text(json.dumps({"rows": rows, "cpu_fallback": fallbacks}, indent=1))
    bad = [r for r in rows if r["cos"] < MIN_COS[quant]]
    assert not bad, bad


def test_convert_with_the_toolkit_runs_on_the_mock(tmp_path) -> None:
    calib = tmp_path / "calib.jsonl"
    rng = np.random.default_rng(1)
    calib.write_text("\n".join(json.dumps({"ids": rng.integers(2, 256, 48).tolist()})
                               for _ in range(2)))
    out = tmp_path / "bundle"
    report = convert(ORACLE_DIR / "plainq_released", out, ConvertOptions(
        quant="w8a8", experts="int4", chunk=CHUNK, block_size=16, calibration=calib,
        w8a8_algorithm="mmse", w8a8_hybrid_cos=HYBRID_COS,
        tokenizer=FIXTURES / "tokenizer" / "compact" / "tokenizer.json", npu_budget=0,
        progress=False))
    rknn = sorted(out.glob("stages/*.rknn"))
    assert len(rknn) == 17 and all(p.read_bytes()[:4] != b"LING" for p in rknn)
    assert all(report.stage_bytes[p.stem] == p.stat().st_size for p in rknn)
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    assert {json.dumps(s["quantization"], sort_keys=True) for s in stages.values()} == {
        json.dumps({"algorithm": "mmse", "hybrid_cos": HYBRID_COS, "calibration_samples": 8},
                   sort_keys=True)}
    model = Model.from_bundle(out, executor="mock", verify="full")
    ref = np.load(ORACLE_DIR / "plainq_released" / "reference.npz")
    logits = model.forward(ref["input_ids"][:32], model.new_state())
    assert logits.shape == (32, 256) and np.isfinite(logits).all()


def _top1_and_kl(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(got)
    return (float((ref.argmax(-1) == got.argmax(-1)).mean()),
            float((np.exp(lp) * (lp - lq)).sum(-1).mean()))


def test_quantized_end_to_end_in_simulator(setup, tmp_path) -> None:
    """The issue's quantized end to end with the toolkit's own quantizer: every dense stage
    in rknn-toolkit2's simulator (built once, then called chunk by chunk) and the routed
    experts as int4 QMoE, against the float32 numpy model over 256 teacher-forced
    positions; w8a8 with fp16 experts and fp16 stages split the figure. ``E2E_BOUNDS``
    says why the bounds are loose on this checkpoint."""
    w, calib, _, _ = setup
    ids = np.random.default_rng(11).integers(2, 256, E2E_POSITIONS)
    ref_model = Model.from_hf(ORACLE_DIR / FIXTURE)
    ref = ref_model.forward(ids, ref_model.new_state())
    calib_ids = tmp_path / "calib.jsonl"  # routing counts only: stages come from `calib`
    calib_ids.write_text(json.dumps({"ids": ids[:64].tolist()}))
    models = {}
    for experts in ("int4", "fp16"):  # the bundle gives the CPU experts and glue
        out = tmp_path / experts
        convert(ORACLE_DIR / FIXTURE, out, ConvertOptions(
            quant="fp16", experts=experts, chunk=CHUNK, block_size=16, build_rknn=False,
            calibration=calib_ids,
            tokenizer=FIXTURES / "tokenizer" / "compact" / "tokenizer.json", npu_budget=0,
            progress=False))
        models[experts] = Model.from_bundle(out, executor="mock")
    sources = {}
    for name in models["int4"].bundle.manifest.stages:
        graph = build_stage(w, name, np.float32)
        sources[name] = (tmp_path / f"{name}.onnx", graph.inputs)
        onnx.save(graph.model, str(sources[name][0]))
    figures = {}
    for quant, expert_kinds in (("w8a8", ("int4", "fp16")), ("fp16", ("fp16",))):
        jobs = [SimulatedStage(spec, sources[name][0], quant,
                               calib.samples(name, sources[name][1], CALIB_SAMPLES)
                               if quant == "w8a8" else None,
                               hybrid_cos=DEFAULTS.w8a8_hybrid_cos,
                               algorithm=DEFAULTS.w8a8_algorithm)
                for name, spec in models["int4"].bundle.manifest.stages.items()]
        with SimulatedGraphs(jobs) as sim:
            for experts in expert_kinds:
                model = models[experts]
                model.stages.replace_executors(sim.executors())
                figures[quant, experts] = _top1_and_kl(
                    ref, model.forward(ids, model.new_state()))
    for (quant, experts), (agree, kl) in figures.items():
        print(f"\n[simulator e2e] {FIXTURE}: {quant} stages (toolkit simulator) + {experts} "
              f"experts, {E2E_POSITIONS} positions: top-1 agreement {agree:.3f}, "
              f"mean KL {kl:.4f}")
    for key, (min_top1, max_kl) in E2E_BOUNDS.items():
        agree, kl = figures[key]
        assert agree >= min_top1 and kl <= max_kl, (key, agree, kl)

"""Conversion time and peak RAM for a checkpoint with Ling-3.0-tiny's real per-layer
dimensions (hidden 1536, 16 heads, KDA head 128, MLA q_lora 256 / kv_lora 512, dense FFN
4608, experts 512 wide + a shared one, vocab 157184) and fewer layers / experts.

The checkpoint is random bf16, written tensor by tensor with numpy (no torch) into a temp
dir in the released checkpoint's layout. The conversion runs in a child process so its
peak RSS (``ru_maxrss`` of the child) is the converter's own.

    .venv/bin/python tests/bench/bench_convert.py [--layers 4] [--experts 16] \
        [--target rk3588] [--quant fp16] [--expert-format int4] [--keep DIR]

``--target rk3588`` uses placeholder ``.rknn`` files unless ``--build-rknn`` is given
(the toolkit build of the lm_head alone takes minutes at this vocabulary).

``--per-stage-kind`` measures the rknn-toolkit2 build instead, once per stage kind (KDA in,
KDA out (MoE), MLA in, MLA out (MoE), dense layer-0 out, final/lm_head, one NPU expert),
in fp16 and in w8a8 with the converter's default calibration (built-in prompts, chunk 64,
``ConvertOptions.calibration_samples``), and extrapolates to the full model's stage list:

    .venv/bin/python tests/bench/bench_convert.py --per-stage-kind [--quants fp16,w8a8] \
        [--kinds ...] [--stage-timeout 1500] [--json figures.json]

Each build runs in its own child that calls ``convert.rknn_toolkit.build_rknn``; the peak
RSS reported is ``ru_maxrss`` over that child's children, i.e. the toolkit process alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"

REAL = dict(
    architectures=["BailingMoeV3ForCausalLM"], model_type="bailing_hybrid",
    hidden_size=1536, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, intermediate_size=4608, moe_intermediate_size=512,
    moe_shared_expert_intermediate_size=512, n_shared_experts=1, num_experts_per_tok=8,
    n_group=8, topk_group=4, first_k_dense_replace=1, vocab_size=157184,
    layer_group_size=4, short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0,
    rope_theta=6e6, max_position_embeddings=131072, rms_norm_eps=1e-6,
    routed_scaling_factor=2.5, norm_topk_prob=True, score_function="sigmoid",
    topk_method="noaux_tc", moe_router_enable_expert_bias=True, tie_word_embeddings=False,
    eos_token_id=156895, pad_token_id=156892, bos_token_id=None, use_kda_lora=False,
    no_kda_lora=True, num_kv_heads_for_linear_attn=0, num_nextn_predict_layers=0,
    rope_scaling=None, hidden_act="silu", attention_bias=False,
    gated_attention_proj_granularity_type="head_wise", router_dtype="fp32",
)


def _bf16(x: np.ndarray) -> bytes:
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x8000) >> 16).astype(np.uint16).tobytes()  # round to nearest


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], float, str]]:
    """(name, shape, init scale, dtype) of every tensor, released-checkpoint names."""
    d, h, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    p = h * hd
    e, ie, ish = cfg["num_local_experts"], cfg["moe_intermediate_size"], \
        cfg["moe_shared_expert_intermediate_size"]
    specs = [("model.word_embeddings.weight", (cfg["vocab_size"], d), 1.0, "BF16")]
    for i in range(cfg["num_hidden_layers"]):
        a, m = f"model.layers.{i}.attention.", f"model.layers.{i}.mlp."
        specs += [(f"model.layers.{i}.input_layernorm.weight", (d,), 0.0, "BF16"),
                  (f"model.layers.{i}.post_attention_layernorm.weight", (d,), 0.0, "BF16")]
        if (i + 1) % cfg["layer_group_size"]:
            specs += [(a + f"{n}_proj.weight", (p, d), d ** -0.5, "BF16") for n in "qkvfg"]
            specs += [(a + "b_proj.weight", (h, d), d ** -0.5, "BF16"),
                      (a + "o_proj.weight", (d, p), p ** -0.5, "BF16"),
                      (a + "o_norm.weight", (hd,), 0.0, "BF16"),
                      (a + "dt_bias", (p,), 0.1, "F32"), (a + "A_log", (h,), 0.1, "F32")]
            specs += [(a + f"{n}_conv1d.weight", (p, 1, 4), 0.5, "BF16") for n in "qkv"]
        else:
            r_q, r_kv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            dqk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            specs += [(a + "q_a_proj.weight", (r_q, d), d ** -0.5, "BF16"),
                      (a + "q_a_layernorm.weight", (r_q,), 0.0, "BF16"),
                      (a + "q_b_proj.weight", (h * dqk, r_q), r_q ** -0.5, "BF16"),
                      (a + "kv_a_proj_with_mqa.weight", (r_kv + cfg["qk_rope_head_dim"], d),
                       d ** -0.5, "BF16"),
                      (a + "kv_a_layernorm.weight", (r_kv,), 0.0, "BF16"),
                      (a + "kv_b_proj.weight", (h * (cfg["qk_nope_head_dim"] +
                                                     cfg["v_head_dim"]), r_kv),
                       r_kv ** -0.5, "BF16"),
                      (a + "g_proj.weight", (h, d), d ** -0.5, "BF16"),
                      (a + "dense.weight", (d, h * cfg["v_head_dim"]), 0.02, "BF16")]
        if i < cfg["first_k_dense_replace"]:
            n = cfg["intermediate_size"]
            specs += [(m + "gate_proj.weight", (n, d), d ** -0.5, "BF16"),
                      (m + "up_proj.weight", (n, d), d ** -0.5, "BF16"),
                      (m + "down_proj.weight", (d, n), n ** -0.5, "BF16")]
            continue
        specs += [(m + "gate.weight", (e, d), d ** -0.5, "F32"),
                  (m + "gate.expert_bias", (e,), 0.01, "F32")]
        for s, width in ((m + "shared_experts.", ish), *((m + f"experts.{x}.", ie)
                                                        for x in range(e))):
            specs += [(s + "gate_proj.weight", (width, d), d ** -0.5, "BF16"),
                      (s + "up_proj.weight", (width, d), d ** -0.5, "BF16"),
                      (s + "down_proj.weight", (d, width), width ** -0.5, "BF16")]
    specs += [("model.norm.weight", (d,), 0.0, "BF16"),
              ("lm_head.weight", (cfg["vocab_size"], d), d ** -0.5, "BF16")]
    return specs


def write_checkpoint(root: Path, layers: int, experts: int, seed: int = 0) -> int:
    """Random bf16 checkpoint streamed to ``root/model.safetensors``; returns its bytes."""
    cfg = dict(REAL, num_hidden_layers=layers, num_local_experts=experts)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    specs = tensor_specs(cfg)
    header, offset = {}, 0
    for name, shape, _, dtype in specs:
        size = int(np.prod(shape)) * (4 if dtype == "F32" else 2)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _name, shape, scale, dtype in specs:
            rows = shape[0]
            step = max(1, (1 << 22) // max(1, int(np.prod(shape[1:]))))
            for start in range(0, rows, step):
                part = (rows if len(shape) == 1 else min(step, rows - start), *shape[1:])
                if scale == 0.0:  # norm weights: around 1
                    x = 1.0 + 0.05 * rng.standard_normal(part, dtype=np.float32)
                else:
                    x = scale * rng.standard_normal(part, dtype=np.float32)
                f.write(x.astype(np.float32).tobytes() if dtype == "F32" else _bf16(x))
                if len(shape) == 1:
                    break
    return (root / "model.safetensors").stat().st_size


CHILD = """
import json, sys, time
from pathlib import Path
from typing import Any
from convert.converter import ConvertOptions, convert
a = json.loads(sys.argv[1])
opts = ConvertOptions(target=a["target"], quant=a["quant"], experts=a["experts"],
                      tokenizer=Path(a["tokenizer"]), calibration=Path(a["calibration"]),
                      build_rknn=a["build"], progress=False, calibration_samples=2)
r = convert(a["src"], a["out"], opts)
print("REPORT " + json.dumps({"seconds": r.seconds, "stage_bytes": r.stage_bytes,
      "tokens": r.calibration_tokens}))
"""


# ---------------------------------------------------------------- toolkit build per stage kind
# kind -> the stage of a 4-layer real-width checkpoint that has it (layer_group_size 4:
# layers 0-2 KDA, 3 MLA; layer 0 dense). The expert is picked after calibration.
STAGE_KINDS = {"kda_in": "layer.1.in", "kda_out": "layer.1.out", "mla_in": "layer.3.in",
               "mla_out": "layer.3.out", "dense_out": "layer.0.out", "expert": None,
               "final": "final"}
KIND_LABELS = {"kda_in": "KDA in", "kda_out": "KDA out (MoE)", "mla_in": "MLA in",
               "mla_out": "MLA out (MoE)", "dense_out": "dense layer-0 out",
               "expert": "NPU expert", "final": "final (lm_head)"}
PREP_LAYERS, PREP_EXPERTS, FULL_LAYERS, FULL_EXPERTS = 4, 16, 24, 128

PREP_CHILD = """
import json, sys, time
from pathlib import Path
from typing import Any
import numpy as np, onnx
from convert.calibration import calibrate, load_prompts
from convert.bundle_files import expert_block, write_cpu_weights, write_experts
from convert.converter import ConvertOptions, build_stage, open_checkpoint
from convert.stage_graphs import expert_graph
from convert.w8a8_twin import quantize_twin
from ling3_rknn.bundle import BundleWriter
from ling3_rknn.tokenizer import Tokenizer
a = json.loads(sys.argv[1])
work, opts = Path(a["work"]), ConvertOptions()
w = open_checkpoint(a["src"])
cfg = w.cfg
t0 = time.perf_counter()
prompts = load_prompts(None, Tokenizer.from_file(a["tokenizer"]).encode_text)
calib = calibrate(w, prompts, opts.chunk, opts.calibration_samples)
out = {"calibration_s": time.perf_counter() - t0, "tokens": calib.tokens, "chunk": opts.chunk,
       "samples": opts.calibration_samples, "kinds": {}}
first_moe = calib.moe_layers.index(1)
for kind, name in a["kinds"].items():
    src = work / f"{kind}.onnx"
    data = src.with_name(src.name + ".data")
    t0 = time.perf_counter()
    if name is None:  # the expert the placement would promote first
        e = int(np.argmax(calib.route_counts[first_moe]))
        name = f"layer.1.expert.{e}"
        gate_up, down = w.expert(1, e)
        graph = expert_graph(name, gate_up, down, cfg, np.float32, data)
        samples = calib.expert_samples(1, e, opts.calibration_samples)
    else:
        graph = build_stage(w, name, np.float32, data)
        samples = calib.samples(name, graph.inputs, opts.calibration_samples)
    onnx.save(graph.model, str(src))
    onnx.checker.check_model(str(src))
    graph_s = time.perf_counter() - t0
    np.savez(work / f"{kind}.calib.npz", **samples)
    t0 = time.perf_counter()
    quantize_twin(src, samples)  # the converter's host-side extra for a w8a8 stage
    out["kinds"][kind] = {"stage": name, "onnx": str(src), "calib": str(work / f"{kind}.calib.npz"),
                          "shape_sets": graph.shape_sets((opts.chunk,)), "graph_s": graph_s,
                          "twin_s": time.perf_counter() - t0}
    print(f"prepared {kind} ({name})", file=sys.stderr, flush=True)
with BundleWriter(work / "pack") as writer:  # the converter's other per-layer work
    t0 = time.perf_counter()
    write_experts(writer, w, 1, opts.experts, expert_block(cfg, opts.block_size))
    out["qmoe_layer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_cpu_weights(writer, w)
    out["cpu_weights_s"] = time.perf_counter() - t0
print("REPORT " + json.dumps(out))
"""

BUILD_CHILD = """
import json, resource, sys, time
from convert.rknn_toolkit import RknnBuildError, build_rknn
a = json.loads(sys.argv[1])
res = {"kind": a["kind"], "quant": a["quant"]}
t0 = time.perf_counter()
try:
    r = build_rknn(a["onnx"], a["out"], a["quant"],
                   calibration=a["calib"] if a["quant"] == "w8a8" else None,
                   dynamic_input=a["shape_sets"], timeout=a["timeout"])
    res.update(ok=True, toolkit_build_s=r.build_seconds, bytes=r.size_bytes,
               cpu_ops=list(r.cpu_ops))
except RknnBuildError as exc:
    res.update(ok=False, step=exc.step, error=str(exc), log_tail=exc.log[-1500:])
res["wall_s"] = time.perf_counter() - t0
# the toolkit process is this child's only child: its own peak, not the bench's
res["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print("REPORT " + json.dumps(res))
"""


def _child(code: str, payload: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], cwd=REPO,
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def _save(path: Path | None, figures: dict) -> None:
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(figures, indent=1) + "\n")
    tmp.replace(path)


def full_model_kinds() -> tuple[list[str], Any]:
    """The stage kind of every dense stage of the real 24-layer model, in call order."""
    from convert.stage_graphs import stage_names
    from ling3_rknn.bundle import StageName
    from ling3_rknn.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(REAL, num_hidden_layers=FULL_LAYERS,
                                     num_local_experts=FULL_EXPERTS))
    kinds = []
    for name in stage_names(cfg):
        stage = StageName.parse(name)
        if stage.layer is None:
            kinds.append("final")
            continue
        attn = cfg.layer_kinds[stage.layer]
        dense = stage.role == "out" and stage.layer < cfg.first_k_dense_replace
        kinds.append("dense_out" if dense else f"{attn}_{stage.role}")
    return kinds, cfg


def npu_expert_estimate(cfg: Any, quant: str, dense_bytes: int) -> int:
    """NPU expert graphs the default plan would build, under uniform routing.

    The real routing is only known after calibrating the real checkpoint; uniform routing
    (each expert picked with p = k / E) spends the call cap on equally likely experts."""
    from convert.placement import default_npu_budget, plan_placement

    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    tokens = 100 * cfg.num_experts
    counts = np.full((len(moe), cfg.num_experts), tokens * cfg.num_experts_per_tok
                     // cfg.num_experts)
    per_weight = 2 if quant == "fp16" else 1
    expert_bytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * per_weight
    names = [f"s{i}" for i in range(2 * cfg.num_hidden_layers + 1)]
    report = plan_placement(counts, moe, tokens, cfg.num_experts_per_tok, expert_bytes,
                            default_npu_budget(dense_bytes), len(names), names)
    return sum(len(ids) for ids in report.plan.npu_experts.values())


def per_stage_kind(args: argparse.Namespace) -> None:
    from convert.rknn_toolkit import rknn_python

    rknn_python()  # fail now, not after the checkpoint and the calibration
    kinds = [k for k in STAGE_KINDS if k in args.kinds.split(",")]
    quants = args.quants.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="ling3-bench-kinds-")) if args.keep is None else args.keep
    src, work = tmp / "hf", tmp / "graphs"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    size = write_checkpoint(src, PREP_LAYERS, PREP_EXPERTS)
    print(f"checkpoint: {PREP_LAYERS} layers, {PREP_EXPERTS} experts, real widths, "
          f"{size / 2**30:.2f} GiB, written in {time.perf_counter() - t0:.1f} s", flush=True)
    prep = _child(PREP_CHILD, {"src": str(src), "work": str(work), "tokenizer": str(TOKENIZER),
                               "kinds": {k: STAGE_KINDS[k] for k in kinds}})
    print(f"calibration: {prep['tokens']} tokens (default prompts), {prep['samples']} samples "
          f"x chunk {prep['chunk']} per stage, {prep['calibration_s']:.1f} s", flush=True)
    figures = {"prep": prep, "builds": {}, "timeout_s": args.stage_timeout}
    # cheap kinds first, the lm_head last (it may hit the timeout)
    for kind in sorted(kinds, key=lambda k: k == "final"):
        for quant in quants:
            k = prep["kinds"][kind]
            res = _child(BUILD_CHILD, {"kind": kind, "quant": quant, "onnx": k["onnx"],
                                       "out": str(work / f"{kind}.{quant}.rknn"),
                                       "calib": k["calib"], "shape_sets": k["shape_sets"],
                                       "timeout": args.stage_timeout})
            figures["builds"][f"{kind}/{quant}"] = res
            _save(args.json, figures)
            state = "ok" if res["ok"] else f"FAILED at {res['step']}: {res['error'][:200]}"
            print(f"  {KIND_LABELS[kind]:<18} {quant}: {res['wall_s']:7.1f} s wall, toolkit "
                  f"peak RSS {res['peak_rss'] / 2**30:5.2f} GiB, "
                  f"{res.get('bytes', 0) / 2**20:7.1f} MiB .rknn  {state}", flush=True)
            (work / f"{kind}.{quant}.rknn").unlink(missing_ok=True)
    report_kinds(figures, kinds, quants)
    _save(args.json, figures)
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)


def report_kinds(figures: dict, kinds: list[str], quants: list[str]) -> None:
    """The per-kind table and its extrapolation to the full model's stage list."""
    builds, prep = figures["builds"], figures["prep"]
    full, cfg = full_model_kinds()
    print(f"\n{'stage kind':<18} {'x full':>6}  " + "  ".join(
        f"{q + ' s':>9} {q + ' GiB':>9} {q + ' MiB':>9}" for q in quants))
    for kind in kinds:
        count = full.count(kind) if kind != "expert" else 0
        cells = []
        for q in quants:
            b = builds.get(f"{kind}/{q}")
            mark = "" if b is None or b["ok"] else ">"  # timed out / failed: a lower bound
            cells.append("{:>9} {:>9} {:>9}".format(
                "-" if b is None else f"{mark}{b['wall_s']:.1f}",
                "-" if b is None else f"{b['peak_rss'] / 2**30:.2f}",
                "-" if b is None or not b["ok"] else f"{b['bytes'] / 2**20:.1f}"))
        print(f"{KIND_LABELS[kind]:<18} {count if count else '':>6}  " + "  ".join(cells))
    missing = sorted(set(full) - set(kinds))
    if missing:
        print(f"no extrapolation: kinds {missing} were not measured")
        return
    scale = FULL_LAYERS / PREP_LAYERS
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    host_fixed = (prep["calibration_s"] * scale + prep["cpu_weights_s"]
                  + prep["qmoe_layer_s"] * moe_layers * FULL_EXPERTS / PREP_EXPERTS)
    print(f"\nfull model: {len(full)} dense NPU stages ({full.count('kda_in')} KDA + "
          f"{full.count('mla_in')} MLA layers, layer 0 dense) + the plan's NPU experts")
    print(f"host-side work besides the toolkit: calibration ~{prep['calibration_s'] * scale:.0f} "
          f"s (x{scale:.0f} layers, an upper estimate), QMoE packing ~"
          f"{prep['qmoe_layer_s'] * moe_layers * FULL_EXPERTS / PREP_EXPERTS:.0f} s "
          f"({moe_layers} layers x {FULL_EXPERTS} experts), CPU weights "
          f"{prep['cpu_weights_s']:.0f} s")
    for q in quants:
        got = {k: builds.get(f"{k}/{q}") for k in kinds}
        if any(b is None for b in got.values()):
            continue
        dense_bytes = sum(got[k].get("bytes", 0) for k in full)
        n_exp = npu_expert_estimate(cfg, q, dense_bytes)
        per_stage = {k: got[k]["wall_s"] + prep["kinds"][k]["graph_s"]
                     + (prep["kinds"][k]["twin_s"] if q == "w8a8" else 0.0) for k in kinds}
        dense_s = sum(per_stage[k] for k in full)
        expert_s = n_exp * per_stage["expert"]
        total = dense_s + expert_s + host_fixed
        worst = max(kinds, key=lambda k: got[k]["peak_rss"])
        lower = "at least " if any(not b["ok"] for b in got.values()) else ""
        print(f"{q}: dense stages {dense_s / 60:.0f} min, ~{n_exp} NPU experts (uniform-routing "
              f"estimate of the default plan) {expert_s / 60:.0f} min, rest "
              f"{host_fixed / 60:.0f} min -> `ling3-rknn convert --quant {q}` {lower}"
              f"~{total / 3600:.1f} h on this host ({total / 3600 - expert_s / 3600:.1f} h with "
              f"--npu-budget 0); largest toolkit RSS {got[worst]['peak_rss'] / 2**30:.2f} GiB "
              f"({KIND_LABELS[worst]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--target", default="rk3588")
    ap.add_argument("--quant", default="fp16")
    ap.add_argument("--expert-format", default="int4")
    ap.add_argument("--build-rknn", action="store_true")
    ap.add_argument("--keep", type=Path, help="write checkpoint + bundle here and keep them")
    ap.add_argument("--per-stage-kind", action="store_true",
                    help="toolkit build time / peak RSS per stage kind, extrapolated")
    ap.add_argument("--quants", default="fp16,w8a8", help="with --per-stage-kind")
    ap.add_argument("--kinds", default=",".join(STAGE_KINDS), help="with --per-stage-kind")
    ap.add_argument("--stage-timeout", type=float, default=1500.0,
                    help="seconds per toolkit build (--per-stage-kind)")
    ap.add_argument("--json", type=Path, help="--per-stage-kind: write the figures here")
    args = ap.parse_args()
    if args.per_stage_kind:
        per_stage_kind(args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="ling3-bench-")) if args.keep is None else args.keep
    src, out = tmp / "hf", tmp / "bundle"
    t0 = time.perf_counter()
    size = write_checkpoint(src, args.layers, args.experts)
    print(f"checkpoint: {args.layers} layers, {args.experts} experts, bf16 "
          f"{size / 2**30:.2f} GiB, written in {time.perf_counter() - t0:.1f} s")
    calib = tmp / "calib.jsonl"
    rng = np.random.default_rng(1)
    calib.write_text("\n".join(json.dumps({"ids": rng.integers(0, 900, 128).tolist()})
                               for _ in range(2)))
    child = {"src": str(src), "out": str(out), "target": args.target, "quant": args.quant,
             "experts": args.expert_format, "tokenizer": str(TOKENIZER),
             "calibration": str(calib), "build": args.build_rknn}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(child)], cwd=REPO,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    report = json.loads(next(line for line in proc.stdout.splitlines()
                             if line.startswith("REPORT "))[7:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    bundle = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"conversion ({args.target}, {args.quant} stages, {args.expert_format} experts, "
          f"{report['tokens']} calibration tokens): {report['seconds']:.1f} s, peak RSS "
          f"{peak / 2**30:.2f} GiB ({peak / size:.2f}x the checkpoint); bundle "
          f"{bundle / 2**30:.2f} GiB")
    print(f"NPU stage bytes: {sum(report['stage_bytes'].values()) / 2**20:.1f} MiB over "
          f"{len(report['stage_bytes'])} graphs")
    if args.keep:
        print(f"files kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

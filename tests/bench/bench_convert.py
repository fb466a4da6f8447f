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
from convert.converter import ConvertOptions, convert
a = json.loads(sys.argv[1])
opts = ConvertOptions(target=a["target"], quant=a["quant"], experts=a["experts"],
                      tokenizer=Path(a["tokenizer"]), calibration=Path(a["calibration"]),
                      build_rknn=a["build"], progress=False, calibration_samples=2)
r = convert(a["src"], a["out"], opts)
print("REPORT " + json.dumps({"seconds": r.seconds, "stage_bytes": r.stage_bytes,
      "tokens": r.calibration_tokens}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--target", default="rk3588")
    ap.add_argument("--quant", default="fp16")
    ap.add_argument("--expert-format", default="int4")
    ap.add_argument("--build-rknn", action="store_true")
    ap.add_argument("--keep", type=Path, help="write checkpoint + bundle here and keep them")
    args = ap.parse_args()
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

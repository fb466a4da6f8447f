"""NPU calls per decoded token and NPU-resident bytes for the Ling-3.0-tiny plan.

Method: a checkpoint with the real per-layer dimensions and 4 layers (KDA + dense FFN,
2 KDA + MoE, MLA + MoE) and 16 experts (bench_convert.write_checkpoint) is converted for
rk3588 with placeholder ``.rknn`` files; ``Model.from_bundle`` runs it through
``RknnLiteExecutor`` on the mock, whose call counter gives the calls per decoded token,
checked against the plan's own expectation. Bytes per stage are the weights at the
stage's precision (fp16: 2 bytes, w8a8: 1 byte per weight); ``--rknn-sizes`` also
builds the four attention stage kinds with rknn-toolkit2 to show the real .rknn sizes.
The 24-layer figures are extrapolated from the per-kind numbers (18 KDA + 6 MLA layers,
layer 0 dense, 23 MoE layers), not measured on a 24-layer bundle.

    .venv/bin/python tests/bench/bench_npu_plan.py [--keep DIR] [--rknn-sizes]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import TOKENIZER, write_checkpoint

from convert.converter import ConvertOptions, convert
from convert.placement import NPU_WINDOW_BYTES, default_npu_budget
from ling3_rknn.model import Model
from ling3_rknn.npu import MockRKNNLite

REAL_LAYERS, REAL_KDA, REAL_MLA = 24, 18, 6


def kind_of(name: str, stage: dict) -> str:
    if name == "final":
        return "final (norm + lm_head)"
    if ".expert." in name:
        return "routed expert"
    head = "MLA" if "q_latent" in stage["outputs"] or "ctx" in stage["inputs"] else "KDA"
    if name.endswith(".in"):
        return f"{head} input"
    return f"{head} output + " + ("dense FFN" if "ffn_delta" in stage["outputs"]
                                   else "shared expert + router")


def convert_bundle(src: Path, out: Path, quant: str, budget: int | None) -> dict:
    calib = src.parent / "calib.jsonl"
    rng = np.random.default_rng(1)
    calib.write_text("\n".join(json.dumps({"ids": rng.integers(0, 900, 96).tolist()})
                               for _ in range(2)))
    if not out.exists():
        convert(src, out, ConvertOptions(quant=quant, tokenizer=TOKENIZER, calibration=calib,
                                         build_rknn=False, progress=False, npu_budget=budget,
                                         calibration_samples=2))
    return json.loads((out / "manifest.json").read_text())


def calls_per_token(bundle: Path, steps: int = 6) -> float:
    model = Model.from_bundle(bundle, executor="mock")
    state = model.new_state()
    logits = model.forward(np.arange(10, 26), state, last_only=True)
    MockRKNNLite.reset_stats()
    for _ in range(steps):
        logits = model.forward([int(np.argmax(logits[-1]))], state)
    return MockRKNNLite.stats["inference"] / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--rknn-sizes", action="store_true")
    args = ap.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="ling3-plan-"))
    src = tmp / "hf"
    if not (src / "model.safetensors").is_file():
        write_checkpoint(src, layers=4, experts=16)
    for quant in ("fp16", "w8a8"):
        man = convert_bundle(src, tmp / f"dense-{quant}", quant, budget=0)
        per_kind: dict[str, int] = {}
        for name, st in man["stages"].items():
            per_kind.setdefault(kind_of(name, st), st["nbytes"])
        count = {"KDA input": REAL_KDA, "KDA output + dense FFN": 1,
                 "KDA output + shared expert + router": REAL_KDA - 1, "MLA input": REAL_MLA,
                 "MLA output + shared expert + router": REAL_MLA, "final (norm + lm_head)": 1}
        total = sum(per_kind[k] * n for k, n in count.items())
        print(f"\n{quant} stages at real width (bytes = weights x {2 if quant == 'fp16' else 1}"
              f"):")
        for k, n in count.items():
            print(f"  {k:<38} {per_kind[k] / 2**20:8.1f} MiB  x {n:2d}")
        print(f"  24-layer dense total: {total / 2**30:.2f} GiB of the "
              f"{NPU_WINDOW_BYTES / 2**30:.0f} GiB window; left for NPU experts by default: "
              f"{default_npu_budget(total) / 2**30:.2f} GiB")
    dense_calls = calls_per_token(tmp / "dense-fp16")
    print(f"\nNPU calls per decoded token, 4-layer bundle, no NPU experts (mock counter): "
          f"{dense_calls:.1f} (plan: 2 x 4 + 1 = 9)")
    man = convert_bundle(src, tmp / "plan-fp16", "fp16", budget=None)
    promoted = sum(len(v) for v in man["placement"]["npu_experts"].values())
    measured = calls_per_token(tmp / "plan-fp16")
    print(f"with the default budget: {promoted} experts promoted, measured {measured:.1f} "
          f"calls per token (16 experts, top-8: every promoted expert is hit half the time)")
    print(f"Ling-3.0-tiny, 24 layers: {2 * REAL_LAYERS + 1} dense calls per token; the "
          f"placement caps dense + expected NPU-expert calls at 60 "
          f"(convert.placement.plan_placement max_calls_per_token)")
    if args.rknn_sizes:
        from convert.rknn_toolkit import build_rknn

        print("\nrknn-toolkit2 .rknn sizes at real width (fp16):")
        for name in ("layer.0.in", "layer.1.out", "layer.3.in", "layer.3.out"):
            onnx_path = tmp / "dense-fp16" / "stages" / f"{name}.onnx"
            st = man["stages"][name]
            res = build_rknn(onnx_path, tmp / f"{name}.rknn", "fp16",
                             dynamic_input=st["shape_sets"])
            print(f"  {name:<12} {res.size_bytes / 2**20:8.1f} MiB (weights "
                  f"{st['nbytes'] / 2**20:.1f} MiB), build {res.build_seconds:.0f} s, "
                  f"CPU fallback: {list(res.cpu_ops) or 'none'}")
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

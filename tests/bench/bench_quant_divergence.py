"""Where the quantized end-to-end divergence of the tiny oracle checkpoints comes from.

``tests/test_convert_bundle.py::test_quantized_end_to_end`` holds w8a8 stages + int4
experts to a loose bound on the tiny random checkpoints. This bench splits the figure:
each stage precision (fp16 twin, w8a8 QDQ twin) x each expert format (fp16, int8, int4),
run through the bundle path on the RKNNLite mock, against the float32 numpy model over
the same teacher-forced positions; and two controls on the *float* model itself,
perturbed by relative Gaussian noise on the expert outputs or on every attention/FFN
delta, to show how chaotic these random 32-wide models are (a trained model is not).

    .venv/bin/python tests/bench/bench_quant_divergence.py [--positions 256] \
        [--checkpoint HF_DIR --tokenizer tokenizer.json]

``--checkpoint`` runs another checkpoint (a trained one) instead of the three fixtures.

Prints top-1 agreement and mean KL(float || variant) per fixture.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
ORACLE = REPO / "tests" / "fixtures" / "oracle"
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
FIXTURES = ("lora_hfsave", "plainq_released", "lora_hfmodule_bf16")
sys.path.insert(0, str(REPO))

from convert.converter import ConvertOptions, convert  # noqa: E402
from ling3_rknn.model import Model  # noqa: E402
from ling3_rknn.model.stages import LayerOutput  # noqa: E402


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || got) over rows."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    return float((ref.argmax(-1) == got.argmax(-1)).mean()), kl


class NoisyExperts:
    """Expert outputs times (1 + rel * N(0, 1)), elementwise."""

    def __init__(self, inner, rel: float, seed: int) -> None:
        self._inner, self._rel, self._rng = inner, rel, np.random.default_rng(seed)

    def __call__(self, layer, x, ids, weights):
        y = self._inner(layer, x, ids, weights)
        return y * (1 + self._rel * self._rng.standard_normal(y.shape)).astype(np.float32)


class NoisyStages:
    """Float stages whose attention / FFN deltas and shared-expert outputs get relative
    noise (cosine ~ 1 / sqrt(1 + rel^2) per output, like a w8a8 stage)."""

    def __init__(self, inner, rel: float, seed: int) -> None:
        self._inner, self._rel, self._rng = inner, rel, np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _noisy(self, a: np.ndarray) -> np.ndarray:
        return a * (1 + self._rel * self._rng.standard_normal(a.shape)).astype(np.float32)

    def _out(self, x: np.ndarray, o: LayerOutput) -> LayerOutput:
        return LayerOutput(hidden=x + self._noisy(o.hidden - x), moe_input=o.moe_input,
                           shared=None if o.shared is None else self._noisy(o.shared),
                           router_logits=o.router_logits)

    def kda_output(self, layer, x, core, out_gate):
        return self._out(x, self._inner.kda_output(layer, x, core, out_gate))

    def mla_output(self, layer, x, ctx, gate):
        return self._out(x, self._inner.mla_output(layer, x, ctx, gate))


def calibration_file(tmp: Path) -> Path:
    rng = np.random.default_rng(7)
    path = tmp / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"ids": rng.integers(2, 256, 90).tolist()})
                              for _ in range(16)), encoding="utf-8")
    return path


def run(src: Path, ids: np.ndarray, tmp: Path, tokenizer: Path
        ) -> list[tuple[str, float, float]]:
    fixture = src.name
    ref_model = Model.from_hf(src)
    ref = ref_model.forward(ids, ref_model.new_state())
    rows = []
    calib = calibration_file(tmp)
    for quant in ("fp16", "w8a8"):
        for experts in ("fp16", "int8", "int4"):
            out = tmp / f"{fixture}-{quant}-{experts}"
            convert(src, out, ConvertOptions(
                quant=quant, experts=experts, chunk=16, block_size=16, calibration=calib,
                calibration_samples=16, tokenizer=tokenizer, build_rknn=False,
                npu_budget=0, progress=False))
            model = Model.from_bundle(out, executor="mock")
            rows.append((f"{quant} stages + {experts} experts",
                         *compare(ref, model.forward(ids, model.new_state()))))
    for rel in (0.01, 0.05):
        noisy = Model.from_hf(src)
        noisy.experts = NoisyExperts(noisy.experts, rel, 0)
        rows.append((f"float, {rel:.0%} noise on expert outputs",
                     *compare(ref, noisy.forward(ids, noisy.new_state()))))
    for rel in (0.01, 0.1):
        noisy = Model.from_hf(src)
        noisy.stages = NoisyStages(noisy.stages, rel, 0)
        rows.append((f"float, {rel:.0%} noise on stage deltas",
                     *compare(ref, noisy.forward(ids, noisy.new_state()))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--checkpoint", type=Path, help="HF checkpoint dir (default: the fixtures)")
    ap.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    args = ap.parse_args()
    ids = np.random.default_rng(11).integers(2, 256, args.positions)
    sources = [args.checkpoint] if args.checkpoint else [ORACLE / f for f in FIXTURES]
    with tempfile.TemporaryDirectory(prefix="ling3-quantdiv-") as tmp:
        for src in sources:
            print(f"\n{src.name}: {args.positions} teacher-forced positions vs the float model")
            print(f"  {'variant':<40} {'top-1':>6} {'mean KL':>8}")
            for name, agree, kl in run(src, ids, Path(tmp), args.tokenizer):
                print(f"  {name:<40} {agree:6.3f} {kl:8.4f}")


if __name__ == "__main__":
    main()

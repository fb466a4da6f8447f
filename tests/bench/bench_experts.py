"""CPU routed-expert and executor-overhead benchmark at Ling-3.0-tiny's real dimensions.

    .venv/bin/python tests/bench/bench_experts.py [--threads 2] [--json out.json]

Measures, per MoE layer: QMoE int4 / int8 (block 32, accuracy_level 4) at T=1 (decode,
8 experts) and T=64 (a prefill chunk, ~126 of 128 experts touched), against the numpy
float executor (fp32 and fp16 weights); then the per-call overhead of the graph
executors on a small graph (raw onnxruntime, OnnxExecutor, RknnLiteExecutor on the mock)
and the host-side quantization time of one real-size layer.

Speed does not depend on weight values, so QMoE runs on random codes and scales (as for
docs/performance.md, "Routed experts on the CPU"); two layers are cycled so the weights do
not sit in the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from convert.experts_quant import quantize_experts
from convert.onnx_ops import GraphBuilder
from convert.qmoe_graph import build_qmoe_model
from ling3_rknn.bundle import StageSpec
from ling3_rknn.model import FloatExperts
from ling3_rknn.npu import (
    MockRKNNLite,
    OnnxExecutor,
    PackedExperts,
    QMoeExperts,
    RknnLiteExecutor,
)

D, INTER, E, K = 1536, 512, 128, 8


def timeit(fn, n: int) -> tuple[float, float]:
    """(median, p10) milliseconds over ``n`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[max(0, len(times) // 10 - 1)]


def random_packed(rng: np.random.Generator, bits: int, block: int = 32) -> PackedExperts:
    per = 8 // bits
    return PackedExperts(
        bits, block,
        rng.integers(0, 256, (E, 2 * INTER, D // per), dtype=np.uint8),
        (rng.random((E, 2 * INTER, D // block), dtype=np.float32) * 0.01 + 1e-3),
        rng.integers(0, 256, (E, D, INTER // per), dtype=np.uint8),
        (rng.random((E, D, INTER // block), dtype=np.float32) * 0.01 + 1e-3),
    )


def routing(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(t)]).astype(np.int64)
    w = rng.random((t, K)).astype(np.float32)
    return ids, (2.5 * w / w.sum(1, keepdims=True)).astype(np.float32)


def bench_experts(threads: int, rows: list[dict], chunks: list[int], *,
                  float_experts: bool = True) -> None:
    rng = np.random.default_rng(0)
    calls = {t: max(3, 48 // t) for t in chunks}
    inputs = {t: [(rng.normal(size=(t, D)).astype(np.float32), *routing(rng, t))
                  for _ in range(8)] for t in calls}

    def cycle(layers, t):
        state = {"i": 0}

        def call():
            i = state["i"] = state["i"] + 1
            x, ids, w = inputs[t][i % len(inputs[t])]
            layers[i % len(layers)].run(x, ids, w)
        return call

    for bits in (4, 8):
        layers = []
        for _ in range(2):
            model = build_qmoe_model(random_packed(rng, bits), K, accuracy_level=4)
            layers.append(QMoeExperts(model.SerializeToString(), hidden_size=D, num_experts=E,
                                      top_k=K, threads=threads))
            del model
        nbytes = random_packed(rng, bits).nbytes
        for t, n in calls.items():
            med, p10 = timeit(cycle(layers, t), n)
            gflops = t * K * 3 * D * INTER * 2 / (p10 * 1e-3) / 1e9
            rows.append({"method": f"QMoE int{bits} g32 acc4", "T": t, "threads": threads,
                         "median_ms": med, "p10_ms": p10, "layer_bytes": nbytes,
                         "ms_per_token": med / t, "gflops_p10": gflops})
            print(f"QMoE int{bits} g32 acc4  T={t:<3} {med:8.2f} ms (p10 {p10:.2f}), "
                  f"{med / t:.3f} ms per token, {gflops:.1f} GFLOP/s at p10", flush=True)
        del layers

    for dtype in (np.float32, np.float16) if float_experts else ():
        gate, up, down = (
            (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype, copy=False)
            for shape in ((E, INTER, D), (E, INTER, D), (E, D, INTER)))
        ex = FloatExperts(gate, up, down, top_k=K)
        name = f"numpy {np.dtype(dtype).name}"
        for t, n in calls.items():
            med, p10 = timeit(cycle([ex], t), max(3, n // 4))
            rows.append({"method": name, "T": t, "threads": threads, "median_ms": med,
                         "p10_ms": p10, "layer_bytes": int(gate.nbytes * 3)})
            print(f"{name:<22} T={t:<3} {med:8.2f} ms (p10 {p10:.2f})", flush=True)
        del gate, up, down, ex


def bench_overhead(rows: list[dict]) -> None:
    import onnx
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    d = 64
    b = GraphBuilder("small")
    x = b.input("hidden", [1, 1, d])
    b.output(b.linear(b.rmsnorm(x, np.ones(d), 1e-6, "n"), rng.normal(size=(d, d)), "p"), "y")
    spec = StageSpec(name="small", onnx="small.onnx", rknn="small.rknn", quant="fp16",
                     inputs=("hidden",), outputs=("y",), shape_sets=(((1, 1, d),),))
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(b.build(), os.path.join(tmp, "small.onnx"))
        Path(tmp, "small.rknn").write_bytes(b"stand-in")
        xv = rng.normal(size=(1, 1, d)).astype(np.float32)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(os.path.join(tmp, "small.onnx"), opts,
                                    providers=["CPUExecutionProvider"])
        onnx_ex = OnnxExecutor(Path(tmp, "small.onnx"), spec)
        rk_ex = RknnLiteExecutor(Path(tmp, "small.rknn"), spec, rknnlite_cls=MockRKNNLite)
        for name, fn in (("raw onnxruntime run", lambda: sess.run(None, {"hidden": xv})),
                         ("OnnxExecutor.run", lambda: onnx_ex.run(xv)),
                         ("RknnLiteExecutor(mock).run", lambda: rk_ex.run(xv))):
            med, p10 = timeit(fn, 2000)
            rows.append({"method": name, "T": 1, "median_us": med * 1e3, "p10_us": p10 * 1e3})
            print(f"{name:<28} {med * 1e3:8.1f} us (p10 {p10 * 1e3:.1f})", flush=True)


def bench_quantize(rows: list[dict]) -> None:
    rng = np.random.default_rng(2)
    gate = (rng.standard_normal((E, INTER, D), dtype=np.float32) * 0.02)
    up = (rng.standard_normal((E, INTER, D), dtype=np.float32) * 0.02)
    down = (rng.standard_normal((E, D, INTER), dtype=np.float32) * 0.02)
    for bits in (4, 8):
        t0 = time.perf_counter()
        quantize_experts(gate, up, down, bits, 32)
        s = time.perf_counter() - t0
        rows.append({"method": f"quantize one layer int{bits}", "seconds": s})
        print(f"quantize one real layer (128 experts) int{bits}: {s:.1f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--skip-quantize", action="store_true")
    p.add_argument("--chunks", default="1,64",
                   help="tokens per call (prefill chunk sizes), e.g. 1,16,64,256")
    p.add_argument("--skip-float", action="store_true", help="QMoE only")
    p.add_argument("--skip-overhead", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    rows: list[dict] = []
    print(f"routed experts, one MoE layer, D={D} I={INTER} E={E} top-{K}, "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    bench_experts(args.threads, rows, [int(c) for c in args.chunks.split(",")],
                  float_experts=not args.skip_float)
    if not args.skip_overhead:
        print("executor overhead per call, small graph (RMSNorm + 64x64 projection)")
        bench_overhead(rows)
    if not args.skip_quantize:
        bench_quantize(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

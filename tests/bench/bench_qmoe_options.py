"""QMoE int4 decode (T=1, 8 of 128 experts) at real width under different kernel and
session options: block size, ``accuracy_level``, thread spinning, thread count.

    .venv/bin/python tests/bench/bench_qmoe_options.py [--n 200]

Random codes and scales (speed does not depend on values); two layers cycled so the
weights are not cache-resident, as in bench_experts.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from convert.qmoe_graph import build_qmoe_model
from ling3_rknn.npu import PackedExperts

D, INTER, E, K = 1536, 512, 128, 8


def packed(rng: np.random.Generator, block: int) -> PackedExperts:
    return PackedExperts(
        4, block,
        rng.integers(0, 256, (E, 2 * INTER, D // 2), dtype=np.uint8),
        rng.uniform(1e-3, 2e-3, (E, 2 * INTER, D // block)).astype(np.float32),
        rng.integers(0, 256, (E, D, INTER // 2), dtype=np.uint8),
        rng.uniform(1e-3, 2e-3, (E, D, INTER // block)).astype(np.float32),
    )


def session(model: bytes, threads: int, spin: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(model, sess_options=opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, D)).astype(np.float32)
    probs = np.full((1, E), -1e4, np.float32)
    weights = np.zeros((1, E), np.float32)
    ids = rng.choice(E, K, replace=False)
    probs[0, ids], weights[0, ids] = 10.0, 1.0 / K
    feeds = {"hidden": x, "router_probs": probs, "router_weights": weights}
    print(f"QMoE int4, T=1, top-{K} of {E}, D={D}, I={INTER}: median ms per MoE layer")
    for block in (32, 64, 128):
        layers = [packed(rng, block) for _ in range(2)]
        for level in (0, 4):
            models = [build_qmoe_model(p, K, accuracy_level=level).SerializeToString()
                      for p in layers]
            for threads, spin in ((2, False), (2, True), (1, False)):
                sessions = [session(m, threads, spin) for m in models]
                for s in sessions:
                    s.run(None, feeds)
                times = []
                for n in range(args.n):
                    t0 = time.perf_counter()
                    sessions[n % 2].run(None, feeds)
                    times.append((time.perf_counter() - t0) * 1e3)
                print(f"  block {block:3d} accuracy_level {level} threads {threads} "
                      f"spinning {'on ' if spin else 'off'}: {statistics.median(times):6.2f}")


if __name__ == "__main__":
    main()

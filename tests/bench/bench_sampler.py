"""Sampler cost per token at Ling-3.0-tiny's vocabulary (157,184).

Run: .venv/bin/python tests/bench/bench_sampler.py
Prints the median time per sampled token for each configuration; target <= 0.5 ms.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ling3_rknn.engine.sampler import Sampler, SamplerSettings

VOCAB = 157_184
TOKENS = 400

CONFIGS = {
    "greedy": SamplerSettings(temperature=0.0),
    "ling3 defaults (T=1, top_k=20, top_p=0.95)": SamplerSettings(top_k=20, top_p=0.95, seed=0),
    "T+top_k+top_p+min_p+penalties": SamplerSettings(
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=0,
    ),
    "top_p only (no top_k; full-vocab normaliser)": SamplerSettings(top_p=0.9, seed=0),
}


def main() -> None:
    rng = np.random.default_rng(0)
    # Realistic-ish logits: a peaked head over a broad tail.
    rows = [(rng.standard_normal(VOCAB) * 2.5).astype(np.float32) for _ in range(16)]
    prompt = rng.integers(0, VOCAB, size=2000).tolist()
    for name, settings in CONFIGS.items():
        sampler = Sampler(settings, VOCAB, prompt_ids=prompt)
        times = []
        for i in range(TOKENS):
            row = rows[i % len(rows)]
            t0 = time.perf_counter()
            token = sampler.sample(row)
            sampler.accept(token)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        p90 = statistics.quantiles(times, n=10)[-1] * 1e3
        print(f"{name:48s} median {ms:.3f} ms/token  p90 {p90:.3f} ms")


if __name__ == "__main__":
    main()

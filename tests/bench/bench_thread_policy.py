"""Out of the box against every manual ``--threads``: decode tok/s of a bundle as ``serve``
loads it.

Each setting runs in its own process (the thread policy is process-wide): ``default`` loads
with ``Model.from_bundle(bundle)`` exactly as ``ling3-rknn serve`` does with no
``--threads`` (and no thread environment variables set), ``N`` with ``threads=N``. Each
prefills a random prompt and then decodes greedily; settings are interleaved over
``--rounds`` and the best round of each is kept. The figure of merit is default / best.

    .venv/bin/python tests/bench/bench_thread_policy.py [BUNDLE] [--context 512]
        [--tokens 48] [--rounds 3]

BUNDLE defaults to the medium ``--target cpu`` bundle ``bench_side_by_side.py`` builds
(``tmp/bench_side_by_side/bundle-cpu-int8``); the embedded demo bundle works too but is
too small for threads to matter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BUNDLE = ROOT / "tmp" / "bench_side_by_side" / "bundle-cpu-int8"

CHILD = r"""
import json, sys, time
import numpy as np
from ling3_rknn.model import Model
bundle, setting, context, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
threads = None if setting == "default" else int(setting)
model = Model.from_bundle(bundle, verify="size", threads=threads)
state = model.new_state()
ids = np.random.default_rng(0).integers(10, model.config.vocab_size - 10, context)
for s in range(0, context, 64):
    logits = model.forward(ids[s:s + 64], state, last_only=True)
token = int(logits[0].argmax())
start = time.perf_counter()
for _ in range(tokens):
    token = int(model.forward([token], state, last_only=True)[0].argmax())
print(json.dumps({"threads": model.threads, "tok_s": tokens / (time.perf_counter() - start)}))
"""


def run(bundle: Path, setting: str, context: int, tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("_NUM_THREADS")}  # out of the box: nothing set by hand
    out = subprocess.run([sys.executable, "-c", CHILD, str(bundle), setting, str(context),
                          str(tokens)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    settings = ["default", *[str(n) for n in range(1, min(cores, 4) + 1)]]
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for setting in settings:
            result = run(args.bundle, setting, args.context, args.tokens)
            print(f"round {r + 1}: {setting:>7} ({result['threads']} threads) "
                  f"{result['tok_s']:.2f} tok/s", flush=True)
            if setting not in best or result["tok_s"] > best[setting]["tok_s"]:
                best[setting] = result
    manual = max((s for s in settings if s != "default"), key=lambda s: best[s]["tok_s"])
    ratio = best["default"]["tok_s"] / best[manual]["tok_s"]
    print(f"\nout of the box: {best['default']['tok_s']:.2f} tok/s "
          f"({best['default']['threads']} threads); best manual --threads {manual}: "
          f"{best[manual]['tok_s']:.2f} tok/s; ratio {ratio:.3f}")


if __name__ == "__main__":
    main()

"""How far the NPU prefill path moves the logits at Ling-3.0-tiny's layer sizes: top-1
agreement and KL against the float32 CPU path, over a long prompt in engine-sized pieces.

Method: a random checkpoint with the real per-layer dimensions (hidden 1536, 16 heads, MLA
512 + 64, KDA 16 x 128; ``--layers`` layers: every fourth MLA, 16 experts, a 4096-token
vocabulary so the logits stay small) written by ``bench_convert.write_checkpoint``, loaded
with ``Model.from_hf`` (float32 numpy stages, the expanded attention on the CPU kernel:
the path the oracle tests pin to transformers), and the same weights with prefill
attention on the NPU (``mla_npu``, the matmul stand-in of librknnrt: the NPU's float16
products, float32 sums). Both evaluate the same ``--tokens`` random ids in the NPU path's
own pieces (two 1024-token pieces per call, in flight); figures per band of 1024 tokens, so
a drift with depth shows. Random weights make near-ties common, so top-1 agreement is a
floor for a trained model's; KL is the figure to watch.

    .venv/bin/python tests/bench/bench_npu_agreement.py [--tokens 4096] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_convert

from ling3_rknn.model import Model
from ling3_rknn.model.mla_npu import open_npu_attention


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--band", type=int, default=1024)
    args = ap.parse_args()
    bench_convert.REAL = dict(bench_convert.REAL, vocab_size=4096, eos_token_id=1, pad_token_id=0)
    with tempfile.TemporaryDirectory(prefix="ling3-agree-") as work:
        root = Path(work) / "ckpt"
        bench_convert.write_checkpoint(root, args.layers, 16, seed=3)
        cpu = Model.from_hf(root)
        attention = open_npu_attention(cpu.config, "on", "mock")
        assert attention is not None
        npu = Model(cpu.config, cpu.stages, cpu.experts, cpu.cpu, threads=cpu.threads,
                    npu_attention=attention)
        ids = np.random.default_rng(0).integers(2, 4096, args.tokens)
        step = npu.prefill_chunk
        out = {}
        for name, model in (("cpu", cpu), ("npu", npu)):
            state = model.new_state()
            t0 = time.perf_counter()
            out[name] = np.concatenate([model.forward(ids[a:a + step], state)
                                        for a in range(0, len(ids), step)])
            print(f"{name}: {time.perf_counter() - t0:.1f} s for {len(ids)} tokens")
    lp, lq = _log_softmax(out["cpu"]), _log_softmax(out["npu"])
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    top = out["cpu"].argmax(axis=1) == out["npu"].argmax(axis=1)
    print(f"\n{args.layers} layers at full width, {args.tokens} tokens, NPU attention on the "
          "stand-in against the float32 CPU path:")
    print(f"{'band':>12} {'top-1 agree':>12} {'KL mean':>10} {'KL max':>10} {'max |dlogit|':>13}")
    for a in range(0, len(ids), args.band):
        b = slice(a, a + args.band)
        d = np.abs(out["cpu"][b] - out["npu"][b]).max()
        print(f"{a:>5}-{min(a + args.band, len(ids)):<6} {top[b].mean():12.4f} "
              f"{kl[b].mean():10.2e} {kl[b].max():10.2e} {d:13.2e}")
    print(f"{'all':>12} {top.mean():12.4f} {kl.mean():10.2e} {kl.max():10.2e}")


if __name__ == "__main__":
    main()

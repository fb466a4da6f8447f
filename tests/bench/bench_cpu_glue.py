"""CPU time per decoded token of the glue that stays on the CPU on the board.

Real Ling-3.0-tiny dimensions (hidden 1536, 16 heads, KDA head 128, MLA latent 512 + 64 rope;
18 KDA + 6 MLA layers, 23 MoE routers over 128 experts) with random inputs of the right
shapes, calling the same functions ``Model.forward`` calls:

- KDA (18 layers): ``short_conv`` + ``prepare_qkv`` + ``kda_core`` (T = 1: the recurrence);
- MLA (6 layers): ``rope_angles``/``apply_rope`` + ``LatentCache.append`` + ``mla_attention``
  (absorbed: scores and context over the 576-wide cached latent; the W_kb / W_vb products
  belong to the NPU stages) over a context of 512, 4K and 32K tokens;
- routing (23 layers): ``route``.

Run: ``.venv/bin/python tests/bench/bench_cpu_glue.py [--tokens N] [--contexts 512,4096,32768]``
Prints per-part and total milliseconds per token over N decode steps: the median and the
minimum of the process CPU time (the machine is shared, so the minimum is the best estimate
of the cost itself), and the median wall time. BLAS runs single-threaded unless
OPENBLAS_NUM_THREADS is set, so CPU time is the cost on one core.

Floors worth knowing when reading the figures: the KDA states are 18 x 1 MB (fp32, as in
transformers), so every decode step streams them at least twice (the reads and the update);
one in-place numpy pass over all 18 costs ~3.6 ms on this host, and the numpy form takes
about four passes (a fused compiled kernel would be the next step). Absorbed MLA costs
16 x (576 + 512) multiply-adds per cached token per layer: 0.86 GFLOP per token at 4K,
~28 ms at this host's ~31 GFLOP/s single-core sgemm peak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import numpy as np

from ling3_rknn.config import ModelConfig
from ling3_rknn.model.kda import kda_core, prepare_qkv, short_conv
from ling3_rknn.model.mla import apply_rope, mla_attention, rope_angles
from ling3_rknn.model.moe import route
from ling3_rknn.model.state import SequenceState

H, DK, D = 16, 128, 1536
P = H * DK
KDA_LAYERS, MLA_LAYERS, MOE_LAYERS = 18, 6, 23
R, DR = 512, 64
E = 128


def real_config() -> ModelConfig:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_config import TINY  # the released Ling-3.0-tiny values

    return ModelConfig.from_dict(TINY)


class Glue:
    def __init__(self, cfg: ModelConfig, context: int, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.rng = rng
        self.state = SequenceState(cfg)
        f32 = np.float32
        self.conv_taps = rng.standard_normal((4, 3 * P)).astype(f32) * 0.5
        self.bias = (0.1 * rng.standard_normal(E)).astype(f32)
        for i in cfg.kda_layers:
            r = self.state.recurrent[i]
            r.set(0.01 * rng.standard_normal(r.body.shape).astype(f32))
        rows = rng.standard_normal((context, R + DR)).astype(f32)
        for cache in self.state.latents.values():
            cache.append(rows)
        self.state.length = context
        self.times = {"kda": [], "mla": [], "route": []}
        self.cpu = {"kda": [], "mla": [], "route": []}

    def step(self) -> None:
        f32, rng, st = np.float32, self.rng, self.state
        qkv = rng.standard_normal((1, 3 * P)).astype(f32)
        g = (-5.0 / (1.0 + np.exp(-rng.standard_normal((1, H, DK))))).astype(f32)
        beta = rng.random((1, H)).astype(f32)
        q_latent = rng.standard_normal((1, H, R)).astype(f32)
        q_rope = rng.standard_normal((1, H, DR)).astype(f32)
        latent = rng.standard_normal((1, R)).astype(f32)
        k_rope = rng.standard_normal((1, DR)).astype(f32)
        logits = rng.standard_normal((1, E)).astype(f32)

        t0, c0 = time.perf_counter(), time.process_time()
        for i in self.cfg.kda_layers:
            out, st.conv[i] = short_conv(qkv, st.conv[i], self.conv_taps)
            q, k, v = prepare_qkv(out, H, DK)
            kda_core(q, k, v, g, beta, st.recurrent[i])
        t1, c1 = time.perf_counter(), time.process_time()
        pos = np.array([st.length])
        for i in self.cfg.mla_layers:
            cos, sin = rope_angles(pos, DR, self.cfg.rope_theta)
            qr = apply_rope(q_rope, cos, sin)
            cache = st.latents[i]
            cache.append(np.concatenate([latent, apply_rope(k_rope, cos, sin)], axis=1))
            mla_attention(q_latent, qr, cache.blocks(), cache.length, 192**-0.5)
        t2, c2 = time.perf_counter(), time.process_time()
        for _ in range(MOE_LAYERS):
            route(
                logits,
                self.bias,
                n_group=8,
                topk_group=4,
                top_k=8,
                normalize=True,
                scaling=2.5,
            )
        t3, c3 = time.perf_counter(), time.process_time()
        st.length += 1
        for key, (a, b), (ca, cb) in (
            ("kda", (t0, t1), (c0, c1)),
            ("mla", (t1, t2), (c1, c2)),
            ("route", (t2, t3), (c2, c3)),
        ):
            self.times[key].append((b - a) * 1e3)
            self.cpu[key].append((cb - ca) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=30, help="decode steps per context")
    ap.add_argument("--contexts", default="512,4096,32768")
    args = ap.parse_args()
    cfg = real_config()
    assert cfg.kda_layers.__len__() == KDA_LAYERS and len(cfg.mla_layers) == MLA_LAYERS
    rng = np.random.default_rng(0)
    print(
        f"numpy {np.__version__}, {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        f"{'context':>8} | CPU ms/token, median: {'KDA':>6} {'MLA':>7} {'route':>6} {'total':>7}"
        f" | total min | wall median"
    )
    for ctx in (int(c) for c in args.contexts.split(",")):
        glue = Glue(cfg, ctx, rng)
        for _ in range(3):  # warm-up
            glue.step()
        for v in (*glue.times.values(), *glue.cpu.values()):
            v.clear()
        for _ in range(args.tokens):
            glue.step()
        med = {k: statistics.median(v) for k, v in glue.cpu.items()}
        totals = [sum(x) for x in zip(*glue.cpu.values(), strict=True)]
        wall = statistics.median([sum(x) for x in zip(*glue.times.values(), strict=True)])
        print(
            f"{ctx:>8} | {'':>21} {med['kda']:6.2f} {med['mla']:7.2f} {med['route']:6.2f} "
            f"{statistics.median(totals):7.2f} | {min(totals):9.2f} | {wall:11.2f}"
        )


if __name__ == "__main__":
    main()

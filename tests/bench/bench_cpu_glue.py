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

Figures on this host (2 shared x86-64 cores, load average ~2.5; ``--tokens 30``, CPU ms per
token, median; KDA / MLA / routing / total):

    context   before (issue 2)            now
    512       15.7 / 6.8 / 2.0 / 24.5     10.2 / 6.5 / 1.2 / 18.0
    4K        18.1 / 46.2 / 2.1 / 66.6     9.9 / 43.1 / 1.2 / 54.6
    32K       18.0 / 363 / 2.1 / 384      10.7 / 338 / 1.2 / 349

With OPENBLAS_NUM_THREADS=2 the wall time gets far *worse* here (median 195 / 220 / 1034 ms):
the BLAS threads spin on a core other processes want, and these GEMMs are too small to
split. Keep the glue on one BLAS thread unless a board measurement says otherwise.

Floors (``--floors`` measures them): the targets (<= 5 ms at 512, <= 15 ms at 4K) are below
what this host can do with float32 numpy/BLAS.

- MLA is compute-bound: absorbed attention costs 16 x (576 + 512) multiply-adds per cached
  token per layer, 0.107 / 0.856 / 6.85 GFLOP per token at 512 / 4K / 32K. One core's sgemm
  peak is ~36 GFLOP/s (1024^3); the 16-column block products reach ~23. So MLA alone needs
  >= 23.6 ms at 4K even at the square-GEMM peak (36.9 ms at the block-shape rate; 43 ms
  measured, the rest being the softmax: np.exp runs at ~4 ns per float32 here and a token
  at 4K needs 96 x 4096 of them). At 512 MLA needs >= 3.0 ms at peak, 4.6 ms at the
  block-shape rate. onnxruntime's MLAS GEMM was measured no faster (~20 GFLOP/s) for the
  same shapes, and the block size (256 to 4096 rows, contiguous) changes nothing.
- KDA is memory-bound: the 18 states are 18 MB of float32 (as in transformers), larger
  than the L3, so a token must stream them at least once: one read pass costs ~1.9 ms;
  both reads as one batched numpy matmul ~4.4 ms (16 small GEMMs per layer, packing
  overhead). The correction is queued and applied as a rank-16 product every 16 tokens,
  so the per-token update pass is gone (see ``RecurrentState``). The rest is the conv +
  SiLU (~1.8 ms: 18 x 6144 exps), the queued-correction reads (~1 ms) and the row folds.
  The benchmark's decays (median factor 0.08 per token, every channel) force frequent folds;
  real KDA decays are milder for most channels. Measured and rejected: the conv + SiLU +
  q/k norms + decay as one onnxruntime graph per layer (3.4-3.6 ms/token against numpy's
  3.0: ~20 us per run() eats the fusion gain); numexpr for the SiLU (73 us against 33 for
  6144 values: its per-call setup dominates at this size); queue depths 8 / 16 / 32 (equal
  within noise).
- So at 512 the sum of the hard floors (MLA at the sgemm peak + one KDA read pass) is
  ~5 ms with zero overhead: the 5 ms target needs a compiled fused kernel (one pass per
  KDA head with both reads and the rank-1 update while the 64 KB head state is in L1/L2;
  a 16-column MLA micro-kernel without packing) or the board's own figures.
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


def _median_cpu_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append((time.process_time() - c0) * 1e3)
    return statistics.median(times)


def floors(rng: np.random.Generator) -> None:
    """Measure what bounds the figures from below on this host (one core, CPU ms)."""
    f32 = np.float32
    states = [rng.standard_normal((H, DK, DK)).astype(f32) for _ in range(KDA_LAYERS)]
    x = rng.standard_normal((H, 2, DK)).astype(f32)
    one_pass = _median_cpu_ms(lambda: [s.sum() for s in states], 21)
    reads = _median_cpu_ms(lambda: [np.matmul(x, s) for s in states], 21)
    print(f"KDA: one read pass over the {KDA_LAYERS} states (np.sum): {one_pass:.2f} ms/token")
    print(f"KDA: both reads, batched [H,2,d]x[H,d,d] matmul x {KDA_LAYERS}: {reads:.2f} ms/token")
    square = rng.standard_normal((1024, 1024)).astype(f32)
    peak = 2 * 1024**3 / _median_cpu_ms(lambda: square @ square, 7) / 1e6
    block = rng.standard_normal((4096, R + DR)).astype(f32)
    q_t = rng.standard_normal((R + DR, H)).astype(f32)
    p = rng.random((4096, H)).astype(f32)
    blocks = [block[i : i + 256] for i in range(0, 4096, 256)]
    ms_s = _median_cpu_ms(lambda: [b @ q_t for b in blocks], 21)
    ms_c = _median_cpu_ms(lambda: [b[:, :R].T @ p[:256] for b in blocks], 21)
    skinny_s = 2 * 4096 * (R + DR) * H / ms_s / 1e6
    skinny_c = 2 * 4096 * R * H / ms_c / 1e6
    print(f"sgemm, one core: square 1024^3 {peak:.1f} GFLOP/s; MLA block shapes: scores "
          f"[256x576]x[576x16] {skinny_s:.1f}, context [512x256]x[256x16] {skinny_c:.1f}")
    skinny = 2 / (1 / skinny_s + 1 / skinny_c)
    for ctx in (512, 4096, 32768):
        gflop = MLA_LAYERS * 2 * H * (2 * R + DR) * ctx / 1e9
        print(f"MLA at {ctx:>5}: {gflop:.3f} GFLOP/token -> {gflop / peak * 1e3:6.1f} ms at the "
              f"square-sgemm peak, {gflop / skinny * 1e3:6.1f} ms at the block-shape rate")
    big = rng.standard_normal(1 << 20).astype(f32)
    exp_ns = _median_cpu_ms(lambda: np.exp(big), 11) * 1e6 / big.size
    print(f"np.exp float32: {exp_ns:.2f} ns/element (MLA softmax: {MLA_LAYERS * H} exps per "
          f"cached token)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=30, help="decode steps per context")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--floors", action="store_true", help="only measure the floors")
    args = ap.parse_args()
    cfg = real_config()
    assert cfg.kda_layers.__len__() == KDA_LAYERS and len(cfg.mla_layers) == MLA_LAYERS
    rng = np.random.default_rng(0)
    print(
        f"numpy {np.__version__}, {os.cpu_count()} CPUs, OPENBLAS_NUM_THREADS="
        f"{os.environ['OPENBLAS_NUM_THREADS']}, load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    if args.floors:
        floors(rng)
        return
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

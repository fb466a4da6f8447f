"""The CPU work left per prompt token when the NPU runs prefill's matmuls, at Ling-3.0-tiny's
size, on this host, and what it projects to on four Cortex-A76 cores.

With the stage graphs, attention's matmuls (Q.K^T, P.V and the projections around them)
and the routed experts' matmuls on the NPU, the CPU still does, per prompt token: the
online softmax between the two attention matmuls, the float16 conversions of the NPU's
operands and the rows' native-layout writes, the KDA chunked recurrence (18 layers),
routing and the experts' activation quantisation, SwiGLU and scatter (23 layers), and the
engine's Python. The lesson from the
llama.cpp fork that runs attention on this NPU: once the matmuls move, that residue is the
limit. So it is measured here, part by part, with the NPU's share taking no time at all (a
runtime whose runs return at once): what is left is the CPU's.

1. **Attention's CPU share** (``mla_npu.NpuAttention.attend`` on an instant NPU): a chunk of
   ``--chunk`` tokens over a cache of each ``--depths``, all 16 heads, 6 MLA layers (the
   online softmax, the float16 operands); the rows' (``NpuRows.extend``: their float16
   conversion and native-layout writes) for the chunk's own rows.
   The projections around the NPU's attention matmuls (queries into each head's space,
   the rows of every head, the context back to the latent) run on the NPU too
   (``LayerProjections``): here they take no time, their NPU time is in the budget below.
2. **KDA chunks** (``kda_chunk.c`` through ``kda_chunked``): a 256-token piece, 16 heads x
   128, per token x 18 layers.
3. **Experts' CPU share**: routing (``moe.route``, 128 experts, 8 of 8 groups' top 4, top-8)
   and the int8 activation work around the NPU's matmuls (``moe_int8``: per-token
   quantisation of the gathered hidden states, SwiGLU on the dequantised gate/up and
   quantisation of the intermediate, the weighted scatter back), per token x 23 layers.

Averaged over an opencode first request (16,604 tokens: mean depth 8.3K), one thread, best
of ``--rounds``. The projection to 4 x A76 scales by the ratio of one core's sgemm here
(numpy's BLAS, measured in the same run) to an A76's: 80 % (assumed) of its float32 peak
(2 x 128-bit FMA pipes: 16 FLOP per cycle at 2.4 GHz = 38.4 GFLOP/s), and divides by 4
cores (the work splits by heads and experts): assumptions the board's ``ling3-rknn bench``
figures check (``prefill_ms_per_token.<size>.cpu_glue``). Nothing asserts on time.

    .venv/bin/python tests/bench/bench_npu_residue.py [--chunk 256] [--rounds 3]
        [--depths 0,4096,8192,16384] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from ling3_rknn.model import moe_int8, native
from ling3_rknn.model.kda import RecurrentState, kda_chunked
from ling3_rknn.model.mla_expanded import mla_bases
from ling3_rknn.model.mla_npu import NpuAttention, NpuAttentionShapes
from ling3_rknn.model.moe import route
from ling3_rknn.npu.matmul_plan import MatmulShape

HEADS, R, DN, DR, DV = 16, 512, 128, 64, 128  # Ling-3.0-tiny's MLA
HIDDEN, EXPERTS, TOP_K, MOE_I = 1536, 128, 8, 512
KDA_LAYERS, MLA_LAYERS, MOE_LAYERS = 18, 6, 23
OPENCODE_TOKENS = 16604
TURN_TOKENS, TURN_DEPTH = 500, 17000  # a later agent turn
A76_GFLOPS = 16 * 2.4  # one core's float32 FMA peak
# what an A76 core's sgemm reaches of that peak (assumed: a NEON sgemm's usual efficiency;
# the board's `ling3-rknn bench` cpu_glue figure checks the projection built on it)
A76_SGEMM_SHARE = 0.8
A76_CORES = 4


class _InstantB:
    nbytes = 0

    def free(self) -> None:
        pass


class _InstantContext:
    """A matmul context whose runs cost nothing: returns one preallocated result."""

    def __init__(self, shape: MatmulShape, rng: np.random.Generator) -> None:
        self.shape = shape
        self._out = (rng.standard_normal((shape.m, shape.n)) * 2).astype(np.float32)

    def new_b(self) -> _InstantB:
        return _InstantB()

    def write_b(self, b: Any, values: np.ndarray, row: int = 0, col: int = 0) -> None:
        pass

    def run(self, a: np.ndarray, b: Any) -> np.ndarray:
        return self._out[:len(a)]

    def close(self) -> None:
        pass


class InstantRuntime:
    name = "instant"

    def __init__(self) -> None:
        self._rng = np.random.default_rng(0)

    def context(self, shape: MatmulShape, *, core: int = 0, domain: int = 0,
                rows: tuple[int, ...] = ()) -> Any:
        return _InstantContext(shape, self._rng)

    def close(self) -> None:
        pass


def best(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def attention_share(chunk: int, depths: list[int], rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    w_kb = rng.standard_normal((HEADS, DN, R)).astype(np.float32) / np.sqrt(R)
    w_vb = rng.standard_normal((HEADS, DV, R)).astype(np.float32) / np.sqrt(R)
    bases = mla_bases(w_kb, w_vb)
    shapes = NpuAttentionShapes(HEADS, R, DN, DR, DV, query_rows=chunk)
    attn = NpuAttention(InstantRuntime(), shapes, cores=1)  # one thread: per-core figures
    out: dict[str, Any] = {}
    latent = rng.standard_normal((chunk, R + DR)).astype(np.float32)
    q_lat = rng.standard_normal((chunk, HEADS, R)).astype(np.float32)
    q_rope = rng.standard_normal((chunk, HEADS, DR)).astype(np.float32)
    for depth in depths:
        rows = attn.new_rows(bases, DR)
        rows.length = depth  # rows before the chunk: their projection is another chunk's
        extend = best(lambda rows=rows, depth=depth: (
            setattr(rows, "length", depth), rows.extend(latent)), rounds)
        rows.length = depth + chunk
        rows._pieces = [rows._pieces[0]] * (-(-(depth + chunk) // shapes.piece_rows))
        attend = best(lambda rows=rows, depth=depth: attn.attend(
            q_lat, q_rope, rows, depth + chunk, 0.07), rounds)
        out[str(depth)] = {"attend_ms_per_token": attend / chunk * 1e3,
                           "rows_ms_per_token": extend / chunk * 1e3,
                           "scores_per_token": HEADS * (depth + chunk / 2)}
    attn.close()
    return out


def kda_share(rounds: int, tokens: int = 256) -> float:
    rng = np.random.default_rng(2)
    d = 128
    q = (rng.standard_normal((tokens, HEADS, d)) / d**0.5).astype(np.float32)
    k = rng.standard_normal((tokens, HEADS, d)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((tokens, HEADS, d)).astype(np.float32)
    log_decay = (-0.1 * np.abs(rng.standard_normal((tokens, HEADS, d)))).astype(np.float32)
    beta = rng.random((tokens, HEADS), dtype=np.float32)
    state = RecurrentState.zeros((HEADS, d, d))
    return best(lambda: kda_chunked(q, k, v, log_decay, beta, state), rounds) / tokens * 1e3


def experts_share(chunk: int, rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((chunk, EXPERTS)).astype(np.float32)
    bias = np.zeros(EXPERTS, np.float32)
    hidden = rng.standard_normal((chunk, HIDDEN)).astype(np.float32)
    routing = best(lambda: route(logits, bias, n_group=8, topk_group=4, top_k=TOP_K,
                                 normalize=True, scaling=2.5), rounds)
    ids, weights = route(logits, bias, n_group=8, topk_group=4, top_k=TOP_K, normalize=True,
                         scaling=2.5)
    gate_up = rng.integers(-2**20, 2**20, (chunk * TOP_K, 2 * MOE_I)).astype(np.int32)
    down = rng.integers(-2**20, 2**20, (chunk * TOP_K, HIDDEN)).astype(np.int32)
    ch_scale = (rng.random(2 * MOE_I) * 1e-4).astype(np.float32)
    ch_down = (rng.random(HIDDEN) * 1e-4).astype(np.float32)

    def around() -> None:  # as NpuLayerExperts._run_compiled: each token quantised once
        order = np.argsort(ids.reshape(-1), kind="stable")  # rows grouped by expert
        tokens = (order // TOP_K).astype(np.int64)
        xq, xs = moe_int8.quantize_rows(hidden, np.arange(chunk, dtype=np.int64))
        xq[tokens]  # the rows gathered for the NPU
        _, h_scale = moe_int8.swiglu_quantize(gate_up, xs[tokens], ch_scale)
        out = np.zeros_like(hidden)
        moe_int8.scatter_add(down, h_scale, ch_down, weights.reshape(-1)[order], tokens, out)

    return {"routing_ms_per_token": routing / chunk * 1e3,
            "activations_ms_per_token": best(around, rounds) / chunk * 1e3}


# Board rates the projection rests on (docs/performance.md "Prefill budget" cites each):
STAGE_TOPS = 1.0  # w8a8 stage graphs, effective (RKLLM's dense models: 0.9-1.1)
STAGE_MACS_PER_TOKEN = 464e6
GRAPH_CALLS_PER_CHUNK = 49
GRAPH_CALL_S = 300e-6  # assumed; `ling3-rknn bench`'s empty_graph.median_us checks it
QK_FLOPS, PV_FLOPS = 900e9, 574e9  # fp16 per NPU core (P.V at K = 2048)
RUN_S = 32.9e-6  # fixed cost of one rknn_matmul_run
INT8_OPS = 1.3e12  # int8 per core at good shapes (0.55-1.9 TOPS by shape and layout)
NPU_READ_BPS = 11.1e9  # per core at M = 1
NPU_CORES = 3
EXPERT_BUCKET = 256  # the largest M an expert matmul context takes


def npu_budget(tokens: int, chunk: int, piece: int = 2048, depth: int = 0
               ) -> dict[str, float]:
    """Seconds of NPU time per phase for ``tokens`` prompt tokens after ``depth`` cached ones,
    in pieces of ``chunk`` (the query rows a piece's matmuls run at), from the rates above:
    attention's matmuls per head and piece (pieces run whole, chunks padded to ``chunk``
    query rows), the experts' matmuls per (expert, projection) with M the expert's share of
    a chunk (routing spread evenly), each at the slower of its arithmetic and reading its
    weights, plus every run's fixed cost; cores in parallel."""
    chunks = -(-tokens // chunk)
    qk, dv = DN + DR, DV
    attn_s = runs = 0.0
    for c in range(chunks):
        pieces = -(-(depth + min(tokens, (c + 1) * chunk)) // piece)
        per_head = pieces * 2 * chunk * piece * (qk / QK_FLOPS + dv / PV_FLOPS)
        attn_s += per_head * HEADS * MLA_LAYERS
        runs += pieces * 2 * HEADS * MLA_LAYERS
    busiest = -(-HEADS // NPU_CORES) / HEADS  # heads are split per core
    attention = attn_s * busiest + runs * RUN_S / NPU_CORES
    # the projections around it (mla_npu.LayerProjections): a chunk's rows for every head
    # [chunk, R] x [R, H (DN + DV)], and per head its queries [chunk, R] x [R, DN] and its
    # context back [chunk, DV] x [DV, R]; at the fp16 rate of Q.K^T's shapes
    projection_flops = 2 * chunk * R * HEADS * (DN + DV) + HEADS * 2 * chunk * R * (DN + DV)
    projections = chunks * MLA_LAYERS * (projection_flops / QK_FLOPS / NPU_CORES
                                         + (1 + 2 * HEADS) * RUN_S / NPU_CORES)
    m = max(1, round(min(chunk, tokens) * TOP_K / EXPERTS))  # tokens per expert per chunk
    expert_s = 0.0
    for k, n in ((HIDDEN, 2 * MOE_I), (MOE_I, HIDDEN)):
        calls = -(-m // EXPERT_BUCKET)
        compute = 2 * m * k * n / INT8_OPS
        weights = calls * k * n / NPU_READ_BPS
        expert_s += max(compute, weights) + calls * RUN_S
    experts = expert_s * EXPERTS * MOE_LAYERS * chunks / NPU_CORES
    stages = 2 * STAGE_MACS_PER_TOKEN * tokens / (STAGE_TOPS * 1e12)
    calls = chunks * GRAPH_CALLS_PER_CHUNK * GRAPH_CALL_S
    return {"stage graphs": stages, "graph calls": calls, "attention matmuls": attention,
            "attention projections": projections, "expert matmuls": experts}


def sgemm_gflops(rounds: int, n: int = 1024) -> float:
    a = np.random.default_rng(4).standard_normal((n, n)).astype(np.float32)
    return 2 * n**3 / best(lambda: a @ a, rounds) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--depths", default="0,4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    with threadpool_limits(1):
        peak = sgemm_gflops(args.rounds)
        attn = attention_share(args.chunk, depths, args.rounds)
        kda = kda_share(args.rounds)
        experts = experts_share(args.chunk, args.rounds)
    # attention at the request's mean depth, interpolated between the measured depths
    mean_depth = OPENCODE_TOKENS / 2
    xs = np.array(depths, float)
    attend = float(np.interp(mean_depth, xs, [attn[str(d)]["attend_ms_per_token"]
                                               for d in depths]))
    rows = float(np.mean([attn[str(d)]["rows_ms_per_token"] for d in depths]))
    parts = {
        "attention (softmax, float16 operands)": attend * MLA_LAYERS,
        "attention rows (float16, native layout)": rows * MLA_LAYERS,
        "KDA chunks": kda * KDA_LAYERS,
        "routing": experts["routing_ms_per_token"] * MOE_LAYERS,
        "experts' activations": experts["activations_ms_per_token"] * MOE_LAYERS,
    }
    total = sum(parts.values())
    a76 = A76_GFLOPS * A76_SGEMM_SHARE
    scale = peak / a76 / A76_CORES
    print(f"native kernels: {native.status()}")
    print(f"one core's sgemm here: {peak:.1f} GFLOP/s; an A76's ({A76_SGEMM_SHARE:.0%} of its "
          f"{A76_GFLOPS:.1f} peak) {a76:.1f}: x{peak / a76:.2f} per core, 4 A76 cores = this "
          f"core / {1 / scale:.2f}")
    print(f"\nper prompt token of an opencode first request ({OPENCODE_TOKENS} tokens, mean "
          f"depth {mean_depth:.0f}), chunk {args.chunk}, one thread here:")
    print(f"{'part':40} {'ms/token here':>14} {'4 x A76 (projected)':>20}")
    for name, ms in parts.items():
        print(f"{name:40} {ms:14.3f} {ms * scale:20.3f}")
    print(f"{'total':40} {total:14.3f} {total * scale:20.3f}")
    whole = total * scale * OPENCODE_TOKENS / 1e3
    print(f"\nwhole request on 4 x A76, CPU residue only: {whole:.1f} s (the NPU's own time "
          "and the overlap are docs/performance.md's)")
    print(f"\nNPU time projected from the cited rates (docs/performance.md), "
          f"{OPENCODE_TOKENS} tokens:")
    npu_by_chunk = {}
    for chunk in sorted({256, 512, 1024, args.chunk}):
        npu = npu_budget(OPENCODE_TOKENS, chunk)
        npu_by_chunk[chunk] = npu
        print(f"  chunk {chunk:5}: " + ", ".join(f"{k} {v:.1f} s" for k, v in npu.items())
              + f"; total {sum(npu.values()):.1f} s")
    npu_total = sum(npu_by_chunk[args.chunk].values())
    cpu_total = whole
    print(f"\nchunk {args.chunk}: NPU {npu_total:.1f} s, CPU residue {cpu_total:.1f} s: "
          f"in turn {npu_total + cpu_total:.1f} s, fully overlapped "
          f"{max(npu_total, cpu_total):.1f} s")
    # a later turn: TURN_TOKENS new tokens after TURN_DEPTH cached ones, one piece (the
    # kept rows cover the cache: only the turn's own rows are projected); attention's CPU
    # share is linear in the depth, so it is extrapolated from the measured depths
    slope, base = np.polyfit(xs, [attn[str(d)]["attend_ms_per_token"] for d in depths], 1)
    turn_attend = (base + slope * (TURN_DEPTH + TURN_TOKENS / 2)) * MLA_LAYERS
    turn_cpu = (turn_attend + total - parts["attention (softmax, float16 operands)"]
                ) * scale * TURN_TOKENS / 1e3
    turn_npu = npu_budget(TURN_TOKENS, min(b for b in (64, 128, 256, 512, 1024)
                                           if b >= TURN_TOKENS), depth=TURN_DEPTH)
    print(f"\na later turn of {TURN_TOKENS} tokens at depth {TURN_DEPTH} (one piece): NPU "
          + ", ".join(f"{k} {v:.2f} s" for k, v in turn_npu.items())
          + f"; total {sum(turn_npu.values()):.2f} s; CPU residue {turn_cpu:.2f} s; in turn "
          f"{sum(turn_npu.values()) + turn_cpu:.2f} s")
    print("\nattention's CPU share per depth (ms per token and layer, one thread):")
    for d in depths:
        a = attn[str(d)]
        print(f"  depth {d:6}: attend {a['attend_ms_per_token']:.4f}, rows "
              f"{a['rows_ms_per_token']:.4f} ({a['scores_per_token'] / 1e3:.0f}K scores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sgemm_gflops": peak, "attention": attn, "kda_ms_per_token_layer": kda,
                       "experts": experts, "parts_ms_per_token": parts,
                       "a76_scale": scale, "chunk": args.chunk,
                       "npu_seconds": {str(k): v for k, v in npu_by_chunk.items()},
                       "cpu_residue_seconds": cpu_total,
                       "later_turn_seconds": {"npu": turn_npu, "cpu": turn_cpu}},
                      f, indent=1)


if __name__ == "__main__":
    main()

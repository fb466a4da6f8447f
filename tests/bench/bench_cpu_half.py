"""The CPU half of one decode step at Ling-3.0-tiny's real dimensions, NPU stages stubbed.

Runs the product's own ``Model.forward`` on one token (24 layers: 18 KDA + 6 MLA, 23 MoE
layers of 128 experts, top-8) with a stage backend that returns precomputed random stage
outputs instantly (what the NPU would hand back), real int4 QMoE routed experts (random
codes: speed does not depend on values; two layers' weights alternate over the 23 so no
expert sits in a cache) and a real sequence state at the given context (KDA states and the
MLA latent cache filled with random rows). Router logits change every step, so the
experts hit vary as in a real decode.

    .venv/bin/python tests/bench/bench_cpu_half.py [--threads 1,2] [--contexts 512,4096]
                                                    [--tokens 40] [--rounds 2]
                                                    [--glue compiled,numpy]

Prints per thread count and context the median ms per token of the whole CPU half and its
parts: routed experts (QMoE, with their Python input preparation), stage stubs (their
Python call cost), and the rest (glue), itself split into KDA (conv, norms, recurrence),
MLA (RoPE, attention), routing, and orchestration (what is left: the layer loop, residual
adds, the model's own Python). Thread
counts are interleaved over ``--rounds`` so machine load hits each alike; the thread
policy (``ling3_rknn.cpu_threads``) is applied exactly as ``serve`` applies it. ``--glue``
interleaves the compiled decode kernels (``ling3_rknn/model/native.py``: KDA step, MLA
attention) with the numpy paths they replace.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ling3_rknn.model.model as model_module
from convert.qmoe_graph import build_qmoe_model
from ling3_rknn import cpu_threads
from ling3_rknn.config import ModelConfig
from ling3_rknn.model import Model, native
from ling3_rknn.model.model import CpuWeights
from ling3_rknn.model.stages import KdaInputs, LayerOutput, MlaInputs
from ling3_rknn.npu import PackedExperts, QMoeExperts

F32 = np.float32


class StubStages:
    """``StageBackend`` answering instantly with fixed random outputs of the right shapes;
    the router logits are redrawn per call so routing varies."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator) -> None:
        h, d, dim = cfg.num_attention_heads, cfg.kda_head_dim, cfg.hidden_size
        self.rng = rng
        self.cfg = cfg
        self.e = cfg.num_experts
        p = h * d
        self.kda = KdaInputs(
            qkv=rng.standard_normal((1, 3 * p)).astype(F32),
            log_decay=(-5.0 / (1.0 + np.exp(-rng.standard_normal((1, h, d))))).astype(F32),
            beta=rng.random((1, h)).astype(F32),
            out_gate=rng.standard_normal((1, h, d)).astype(F32))
        self.mla = MlaInputs(
            q_latent=rng.standard_normal((1, h, cfg.kv_lora_rank)).astype(F32),
            q_rope=rng.standard_normal((1, h, cfg.qk_rope_head_dim)).astype(F32),
            latent=rng.standard_normal((1, cfg.kv_lora_rank)).astype(F32),
            k_rope=rng.standard_normal((1, cfg.qk_rope_head_dim)).astype(F32),
            gate=rng.random((1, h)).astype(F32))
        self.hidden = (0.1 * rng.standard_normal((1, dim))).astype(F32)
        self.logits = rng.standard_normal((1, cfg.vocab_size)).astype(F32)
        self.seconds = 0.0

    def _out(self, layer: int) -> LayerOutput:
        if not self.cfg.is_moe_layer(layer):
            return LayerOutput(hidden=self.hidden)
        t = time.perf_counter()
        out = LayerOutput(hidden=self.hidden, moe_input=self.hidden, shared=self.hidden,
                          router_logits=self.rng.standard_normal((1, self.e)).astype(F32))
        self.seconds += time.perf_counter() - t
        return out

    def embed(self, ids):
        return self.hidden

    def kda_input(self, layer, x):
        return self.kda

    def mla_input(self, layer, x):
        return self.mla

    def kda_output(self, layer, x, core, out_gate):
        return self._out(layer)

    def mla_output(self, layer, x, ctx, gate):
        return self._out(layer)

    def final(self, x):
        return self.logits


class TimedExperts:
    """Two QMoE layers alternating over the MoE layers, timed."""

    def __init__(self, layers: list[QMoeExperts]) -> None:
        self.layers = layers
        self.seconds = 0.0

    def __call__(self, layer, x, ids, weights):
        t = time.perf_counter()
        out = self.layers[layer % len(self.layers)].run(x, ids, weights)
        self.seconds += time.perf_counter() - t
        return out


def real_config() -> ModelConfig:
    from test_config import TINY  # the released Ling-3.0-tiny values

    return ModelConfig.from_dict(TINY)


def qmoe_models(cfg: ModelConfig, rng: np.random.Generator, count: int) -> list[bytes]:
    d, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    models = []
    for _ in range(count):
        packed = PackedExperts(
            4, 32,
            rng.integers(0, 256, (e, 2 * inter, d // 2), dtype=np.uint8),
            rng.uniform(1e-3, 2e-3, (e, 2 * inter, d // 32)).astype(F32),
            rng.integers(0, 256, (e, d, inter // 2), dtype=np.uint8),
            rng.uniform(1e-3, 2e-3, (e, d, inter // 32)).astype(F32))
        models.append(build_qmoe_model(packed, cfg.num_experts_per_tok).SerializeToString())
    return models


def build_model(cfg: ModelConfig, qmoe: list[bytes], threads: int, context: int,
                rng: np.random.Generator) -> tuple[Model, StubStages, TimedExperts, object]:
    cpu_threads.apply_thread_policy(threads)
    experts = TimedExperts([
        QMoeExperts(m, hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                    top_k=cfg.num_experts_per_tok, threads=threads) for m in qmoe])
    stages = StubStages(cfg, rng)
    p = cfg.num_attention_heads * cfg.kda_head_dim
    cpu = CpuWeights(
        conv={i: (0.5 * rng.standard_normal((4, 3 * p))).astype(F32) for i in cfg.kda_layers},
        expert_bias={i: (0.1 * rng.standard_normal(cfg.num_experts)).astype(F32)
                     for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)})
    model = Model(cfg, stages, experts, cpu, threads=threads)
    state = model.new_state()
    for i in cfg.kda_layers:
        body = state.recurrent[i].body
        state.recurrent[i].set(0.01 * rng.standard_normal(body.shape).astype(F32))
    rows = rng.standard_normal((context, cfg.latent_dim)).astype(F32)
    for cache in state.latents.values():
        cache.append(rows)
    state.length = context
    return model, stages, experts, state


GLUE_PARTS = {  # the functions Model.forward calls for each part of the glue
    "kda": ("kda_decode", "short_conv", "prepare_qkv", "kda_core"),
    "mla": ("apply_rope", "mla_attention"),
    "routing": ("route",),
}


class GlueTimers:
    """Times the glue's parts by wrapping the functions ``Model.forward`` calls (its
    module's names), for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(GLUE_PARTS, 0.0)
        self._saved: dict[str, object] = {}

    def _wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t
        return timed

    def __enter__(self) -> GlueTimers:
        for part, names in GLUE_PARTS.items():
            for name in names:
                self._saved[name] = getattr(model_module, name)
                setattr(model_module, name, self._wrap(part, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(model_module, name, fn)


def measure(model: Model, stages: StubStages, experts: TimedExperts, state, tokens: int
            ) -> dict[str, float]:
    model.forward([5], state)  # warm-up (first QMoE runs prepack)
    rows: list[dict[str, float]] = []
    with GlueTimers() as glue:
        for _ in range(tokens):
            experts.seconds = stages.seconds = 0.0
            glue.seconds = dict.fromkeys(GLUE_PARTS, 0.0)
            t = time.perf_counter()
            model.forward([5], state, last_only=True)
            row = {"total": (time.perf_counter() - t) * 1e3, "experts": experts.seconds * 1e3,
                   "stubs": stages.seconds * 1e3}
            row["glue"] = row["total"] - row["experts"] - row["stubs"]
            row.update({part: s * 1e3 for part, s in glue.seconds.items()})
            row["orchestration"] = row["glue"] - sum(row[p] for p in GLUE_PARTS)
            rows.append(row)
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def read_bandwidth(threads: int, nbytes: int = 400 * 2**20, repeats: int = 3) -> float:
    """Bytes per second one streaming read reaches with ``threads`` threads (numpy's sum
    releases the GIL), best of ``repeats``: the memory floor the expert weights and the
    KDA states are read against."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(nbytes // 4, F32)
    parts = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, nbytes / (time.perf_counter() - t))
    return best


def floors(cfg: ModelConfig, threads: int, contexts: list[int]) -> dict[int, dict[str, float]]:
    """ms per token that moving the bytes alone takes: the int4 g32 weights of the routed
    experts hit (8 per MoE layer), one read of every KDA state, one read of the MLA
    latent cache."""
    bw = read_bandwidth(threads)
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    expert_bytes = 3 * d * inter * 0.625 * cfg.num_experts_per_tok * moe_layers
    kda_bytes = len(cfg.kda_layers) * cfg.num_attention_heads * cfg.kda_head_dim ** 2 * 4
    out = {}
    for c in contexts:
        mla_bytes = len(cfg.mla_layers) * c * cfg.latent_dim * 4
        out[c] = {"bandwidth_gb_s": bw / 1e9, "experts": expert_bytes / bw * 1e3,
                  "glue": (kda_bytes + mla_bytes) / bw * 1e3}
    return out


def print_best(results: dict[tuple[int, int, str], list[dict[str, float]]],
               columns: list[tuple[str, int, str]]) -> None:
    """One row per (threads, context, glue path): ``columns`` (key, width, format) of its
    best round (lowest total)."""
    print(f"{'threads':>7} {'context':>7} {'kernels':>8} "
          + " ".join(f"{key:>{width}}" for key, width, _ in columns))
    for (n, context, path), runs in sorted(results.items()):
        best = min(runs, key=lambda r: r["total"])
        print(f"{n:>7} {context:>7} {path:>8} "
              + " ".join(f"{best[key]:>{width}{fmt}}" for key, width, fmt in columns))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, interleaved")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--tokens", type=int, default=40, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--glue", default="compiled",
                    help="decode glue kernels: compiled, numpy, or both (compiled,numpy)")
    args = ap.parse_args()
    paths = args.glue.split(",")
    if "compiled" in paths and not native.available():
        sys.exit(f"the compiled decode kernels are not available: {native.status()}")
    cfg = real_config()
    rng = np.random.default_rng(0)
    print("building two random int4 QMoE layers at real size ...", flush=True)
    qmoe = qmoe_models(cfg, rng, 2)
    threads = [int(t) for t in args.threads.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for context in contexts:
            for n in threads:
                model, stages, experts, state = build_model(cfg, qmoe, n, context, rng)
                for path in paths:
                    native.set_enabled(path == "compiled")
                    results.setdefault((n, context, path), []).append(
                        measure(model, stages, experts, state, args.tokens))
    print(f"\nCPU half of a decode step, ms per token (median of {args.tokens} steps, best "
          f"of {args.rounds} rounds)")
    print_best(results, [("total", 7, ".1f"), ("experts", 8, ".1f"), ("glue", 6, ".1f"),
                         ("stubs", 6, ".2f")])
    print("\nthe glue's parts, ms per token (same runs)")
    print_best(results, [("kda", 6, ".2f"), ("mla", 6, ".2f"), ("routing", 8, ".2f"),
                         ("orchestration", 14, ".2f")])
    print("\nmemory floors (the bytes alone at the measured streaming-read bandwidth)")
    print(f"{'threads':>7} {'context':>7} {'GB/s':>6} {'experts':>8} {'glue':>6}   "
          f"measured/floor experts, glue ({paths[0]} kernels)")
    for n in threads:
        for context, f in floors(cfg, n, contexts).items():
            best = min(results[(n, context, paths[0])], key=lambda r: r["total"])
            print(f"{n:>7} {context:>7} {f['bandwidth_gb_s']:>6.1f} {f['experts']:>8.1f} "
                  f"{f['glue']:>6.1f}   {best['experts'] / f['experts']:.2f}x, "
                  f"{best['glue'] / f['glue']:.2f}x")


if __name__ == "__main__":
    main()

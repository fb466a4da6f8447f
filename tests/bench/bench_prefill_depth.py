"""Prefill at depth: the attention kernel against this host's GEMM rate, a long prompt's speed
per band of context, and an agent's first request, each with the compiled glue and with numpy.

Three measurements, one run (ratios within a run are what count on a shared host):

1. **Attention kernel** at Ling-3.0-tiny's MLA dimensions (16 heads, latent 512 + rope 64), a
   64-token chunk over 4K and 16K cache rows, one thread: GFLOP/s of the compiled prefill kernel
   (``mla_attention.c``'s ``mla_prefill_attend``) and of the numpy path, against a square
   float32 GEMM through numpy's BLAS in the same process (this host's sgemm rate as numpy is
   configured here). Best of ``--rounds``. Beside it the **KDA chunk kernel**
   (``kda_chunk.c``) at Ling-3.0-tiny's KDA size (16 heads x 128) on a 256-token piece, one
   thread, against numpy's chunked form: GFLOP/s of the WY form's arithmetic and ms per
   prompt token and layer.
2. **A long random prompt** (``--tokens``, default 16,384) through ``Model.forward`` in the
   engine's 64-token chunks on a bundle (default: the embedded demo): tok/s per band of
   ``--band`` tokens (the curve, not the average) and, per band, ms per token in the stage
   graphs, the routed experts, MLA attention, the KDA recurrence and the rest.
3. **An agent's first request** (``ling3_rknn.bench.prompts.agent_first_request``: opencode's
   shape and size, 16.6K tokens) through the engine as ``serve`` builds it: time to first
   token cold, then the next session's (same header, new question).

``--glue compiled,absorbed,numpy`` runs 2 and 3 once per glue: as served (compiled kernels and
the expanded MLA prefill form), the compiled kernels with the absorbed form only, and the numpy
glue (the path before the kernels). Nothing asserts on time.

    .venv/bin/python tests/bench/bench_prefill_depth.py [--bundle DIR] [--threads N]
        [--tokens 16384] [--band 1024] [--glue compiled,absorbed,numpy] [--rounds 3]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from threadpoolctl import threadpool_limits

from ling3_rknn.bench import measure as bench_measure
from ling3_rknn.bench import prompts
from ling3_rknn.bench.timers import ComponentTimers
from ling3_rknn.cpu_threads import apply_thread_policy
from ling3_rknn.demo import DEMO_MODEL_ID, bundle_dir
from ling3_rknn.loading import LoadOptions, engine_from_bundle
from ling3_rknn.model import Model, mla, native
from ling3_rknn.model import model as model_module

CHUNK = 64
# compiled: the kernels and the expanded prefill form (as served); absorbed: the kernels with
# the expanded form off; numpy: no kernels (the glue before them)
GLUES = ("compiled", "absorbed", "numpy")


def _gflops(fn: Callable[[], Any], flop: float, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return flop / best / 1e9


def _compiled_and_numpy(fn: Callable[[], Any], flop: float, rounds: int
                        ) -> tuple[float, float]:
    """GFLOP/s of ``fn`` with the compiled kernels, then with numpy's glue."""
    compiled = _gflops(fn, flop, rounds)
    native.set_enabled(False)
    try:
        return compiled, _gflops(fn, flop, rounds)
    finally:
        native.set_enabled(True)


def kernel_figures(rounds: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    heads, r, rope = 16, 512, 64
    square = rng.standard_normal((1024, 1024), dtype=np.float32)
    rows = []
    with threadpool_limits(1):
        for depth in (4096, 16384):
            blocks = [rng.standard_normal((256, r + rope), dtype=np.float32)
                      for _ in range(depth // 256)]
            q_lat = rng.standard_normal((CHUNK, heads, r), dtype=np.float32)
            q_rope = rng.standard_normal((CHUNK, heads, rope), dtype=np.float32)
            flop = 2.0 * CHUNK * heads * depth * (2 * r + rope)

            def attend(q_lat=q_lat, q_rope=q_rope, blocks=blocks, depth=depth) -> Any:
                return mla.mla_attention(q_lat, q_rope, blocks, depth, 0.05)

            compiled, numpy_rate = _compiled_and_numpy(attend, flop, rounds)
            sgemm = _gflops(lambda: square @ square, 2.0 * 1024**3, rounds)
            rows.append({"cache_rows": depth, "kernel_gflops": compiled,
                         "numpy_gflops": numpy_rate, "sgemm_gflops": sgemm,
                         "kernel_vs_sgemm": compiled / sgemm})
    return rows


def kda_chunk_flop(c: int, d: int) -> float:
    """FLOPs of one head's chunk of c rows in the WY form (docs/model.md 4.5): the decayed
    pair products (KK, QK), the forward substitution over [U | W], W S, (q e^G) S, QK V'
    and the state update."""
    pairs = c * (c + 1) / 2
    macs = 2 * pairs * d + (c * (c - 1) / 2) * 2 * d + 3 * c * d * d + pairs * d
    return 2.0 * macs


def kda_figures(rounds: int, tokens: int = 256) -> dict[str, Any]:
    from ling3_rknn.model.kda import CHUNK as KDA_CHUNK
    from ling3_rknn.model.kda import RecurrentState, kda_chunked

    rng = np.random.default_rng(1)
    heads, d = 16, 128
    q = (rng.standard_normal((tokens, heads, d), dtype=np.float32) / d**0.5).astype(np.float32)
    k = rng.standard_normal((tokens, heads, d), dtype=np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((tokens, heads, d), dtype=np.float32)
    log_decay = (-0.1 * np.abs(rng.standard_normal((tokens, heads, d)))).astype(np.float32)
    beta = rng.random((tokens, heads), dtype=np.float32)
    state = RecurrentState.zeros((heads, d, d))
    flop = heads * (tokens // KDA_CHUNK) * kda_chunk_flop(KDA_CHUNK, d)

    def piece() -> Any:
        return kda_chunked(q, k, v, log_decay, beta, state)

    with threadpool_limits(1):
        compiled, numpy_rate = _compiled_and_numpy(piece, flop, rounds)
    per_token = flop / tokens / 1e9 * 1e3  # ms per token at 1 GFLOP/s
    return {"heads": heads, "d": d, "tokens": tokens, "kernel_gflops": compiled,
            "numpy_gflops": numpy_rate, "kernel_ms_per_token": per_token / compiled,
            "numpy_ms_per_token": per_token / numpy_rate}


class _Timed:
    """Wraps the model module's glue functions with timers (as the bench's ComponentTimers
    wraps stages and experts), restored afterwards."""

    NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("mla", "mla_attention"), ("mla", "expanded_attention"), ("kda", "kda_core"))

    def __init__(self) -> None:
        self.seconds = {key: 0.0 for key, _ in self.NAMES}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Timed:
        for key, name in self.NAMES:
            fn = getattr(model_module, name)
            self._saved[name] = fn

            def timed(*a: Any, _fn: Any = fn, _key: str = key, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.seconds[_key] += time.perf_counter() - t0
            setattr(model_module, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(model_module, name, fn)


def band_curve(model: Model, tokens: int, band: int, chunk: int = CHUNK
               ) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    ids = rng.integers(2, model.config.vocab_size, size=tokens)
    state = model.new_state()
    timers = ComponentTimers()
    saved = (model.forward, model.stages, model.experts)
    timers.install(model)
    bands = []
    try:
        with _Timed() as glue:
            for start in range(0, tokens, band):
                timers.reset()
                glue.seconds = dict.fromkeys(glue.seconds, 0.0)
                t0 = time.perf_counter()
                for pos in range(start, min(start + band, tokens), chunk):
                    model.forward(ids[pos:min(pos + chunk, start + band, tokens)], state,
                                  last_only=True)
                seconds = time.perf_counter() - t0
                n = min(band, tokens - start)
                split = timers.prefill
                ms = {"npu_stages": split.stages, "experts": split.experts, **glue.seconds}
                ms["rest"] = seconds - sum(ms.values())
                bands.append({"from": start, "tokens": n, "tok_s": n / seconds,
                              "ms_per_token": {k: 1e3 * v / n for k, v in ms.items()}})
    finally:
        model.stages, model.experts = saved[1], saved[2]
        del model.forward  # the class's method again
    return bands


def report_curve(result: dict[str, Any], name: str, bands: list[dict[str, Any]],
                 tokens: int) -> None:
    total = sum(b["tokens"] for b in bands) / sum(b["tokens"] / b["tok_s"] for b in bands)
    result[name] = {"bands": bands, "tok_s": total}
    print(f"\n{name}: {tokens} tokens at {total:.0f} tok/s; last band / first "
          f"{bands[-1]['tok_s'] / bands[0]['tok_s']:.2f}")
    print("    band   tok/s   ms/token: stages / experts / mla / kda / rest")
    for b in bands:
        ms = b["ms_per_token"]
        print(f"{b['from']:>8} {b['tok_s']:>7.0f}   " + " / ".join(
            f"{ms[k]:.3f}" for k in ("npu_stages", "experts", "mla", "kda", "rest")))


def agent_request(bundle: Path, scratch_bytes: int) -> dict[str, Any]:
    engine = engine_from_bundle(bundle, LoadOptions(prefill_scratch_bytes=scratch_bytes),
                                default_model_id=DEMO_MODEL_ID, verify="size")
    try:
        return asyncio.run(bench_measure.agent_first_request(
            engine, prompts.OPENCODE_FIRST_REQUEST_TOKENS))
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--band", type=int, default=1024)
    ap.add_argument("--glue", default=",".join(GLUES))
    ap.add_argument("--chunks", default=str(CHUNK),
                    help="tokens per forward call, e.g. 64,256 (the engine's prefill piece)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-agent", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    policy = apply_thread_policy(args.threads)
    result: dict[str, Any] = {"load_average": os.getloadavg(), "threads": policy.threads,
                              "native": native.status()}
    print(f"threads {policy.threads}; load average {os.getloadavg()}")
    result["kernel"] = kernel_figures(args.rounds)
    print("\ncache rows   kernel GFLOP/s   numpy GFLOP/s   sgemm GFLOP/s   kernel/sgemm")
    for row in result["kernel"]:
        print(f"{row['cache_rows']:>10} {row['kernel_gflops']:>16.1f} {row['numpy_gflops']:>15.1f}"
              f" {row['sgemm_gflops']:>15.1f} {row['kernel_vs_sgemm']:>14.2f}")
    kda = result["kda_kernel"] = kda_figures(args.rounds)
    sgemm = result["kernel"][-1]["sgemm_gflops"]
    print(f"\nKDA chunk, {kda['heads']} x {kda['d']}: kernel {kda['kernel_gflops']:.1f} GFLOP/s "
          f"({kda['kernel_ms_per_token']:.3f} ms per token and layer), numpy "
          f"{kda['numpy_gflops']:.1f} ({kda['numpy_ms_per_token']:.3f}); kernel/sgemm "
          f"{kda['kernel_gflops'] / sgemm:.2f}")
    bundle = args.bundle or bundle_dir()
    model = Model.from_bundle(bundle, threads=policy.threads, verify="size")
    default_scratch = model.prefill_scratch_bytes
    for glue in args.glue.split(","):
        if glue not in GLUES:
            ap.error(f"--glue: {glue!r} is not one of {', '.join(GLUES)}")
        native.set_enabled(glue != "numpy")
        model.prefill_scratch_bytes = default_scratch if glue == "compiled" else 0
        try:
            for chunk in (int(c) for c in args.chunks.split(",")):
                bands = band_curve(model, args.tokens, args.band, chunk)
                report_curve(result, f"{glue}@{chunk}", bands, args.tokens)
            agent = None if args.skip_agent else agent_request(bundle,
                                                              model.prefill_scratch_bytes)
        finally:
            native.set_enabled(True)
        result[glue] = {"agent_first_request": agent}
        if agent is not None:
            print(f"agent first request: {agent['prompt_tokens']} tokens, TTFT "
                  f"{agent['ttft_s']:.2f} s; next session {agent['next_session_ttft_s']:.2f} s "
                  f"({agent['next_session_cached_tokens']} cached)")
    result["load_average_end"] = os.getloadavg()
    print(f"\nload average at the end {os.getloadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

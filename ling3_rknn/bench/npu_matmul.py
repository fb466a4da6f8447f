"""NPU matmul microbenchmarks at exactly the shapes the prefill plan runs.

The prefill budget (docs/performance.md, issue 38's plan) rests on cited board rates for a
few matmul shapes; this times those shapes through the product's own binding
(``npu/matmul.py``), so the first board run says which assumption failed:

* attention, fp16, per prefill piece (1024 query rows) and head (Ling-3.0-tiny: qk head
  192 = 128 nope + 64 rope, v head 128): Q.K^T m=1024 k=192 n=2048 and P.V m=1024 k=2048
  n=128 (P.V in 2048-row pieces), exactly ``model/mla_npu.py``'s contexts;
* routed experts, int8, m tokens of one expert in {16, 32, 64, 128, 256}: gate+up
  k=1536 n=1024 (both projections in one B) and down k=512 n=1536;
* the fixed cost: int8 1x32x32, next to nothing to compute;
* the expert shapes again through one dynamic-M context per projection (``dynamic``:
  M in {16, ..., 256} over one B, as ``MatmulExpertStore`` runs them): per M the same
  figures, and ``switch_us_per_run``: a run at the smallest M right after one at the
  largest (its ``us_per_run`` plus one ``rknn_matmul_set_dynamic_shape`` and two
  ``set_io_mem``). The question for the board: does M = 16 cost about 1/16 of M = 256,
  or a fixed floor?

Per shape (keyed by figure name; ``shape`` says which): ``us_per_run`` (the binding's
``run``: A copied in, the library call, C copied out), ``npu_us_per_run`` (the library
call alone, ``rerun``) and the GOPS of each, medians over the timed runs. Off a board
they come from the host stand-in and say so (``runtime``): they check the path, not the
NPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np

from ling3_rknn.model.mla_npu import NpuAttentionShapes
from ling3_rknn.npu.matmul import open_runtime
from ling3_rknn.npu.matmul_plan import MatmulError, MatmulShape

EXPERT_ROWS = (16, 32, 64, 128, 256)
# Ling-3.0-tiny's MLA heads as the prefill attention runs them on the NPU
ATTENTION = NpuAttentionShapes(heads=16, rank=512, nope=128, rope=64, dv=128)


def plan_shapes() -> dict[str, MatmulShape]:
    """The prefill plan's matmuls by figure name (the report's keys)."""
    shapes = {
        "attn_qk": ATTENTION.scores,
        "attn_pv": ATTENTION.context,
        "attn_queries": ATTENTION.queries,
        "attn_latents": ATTENTION.latents,
        "attn_rows": ATTENTION.rows,
    }
    for m in EXPERT_ROWS:
        shapes[f"expert_gate_up_m{m}"] = MatmulShape(m, 1536, 1024, "int8")
        shapes[f"expert_down_m{m}"] = MatmulShape(m, 512, 1536, "int8")
    shapes["fixed"] = MatmulShape(1, 32, 32, "int8")
    return shapes


def dynamic_shapes() -> dict[str, MatmulShape]:
    """The expert projections at their largest M, each timed at every M of
    ``EXPERT_ROWS`` through one dynamic context."""
    return {"expert_gate_up": MatmulShape(EXPERT_ROWS[-1], 1536, 1024, "int8"),
            "expert_down": MatmulShape(EXPERT_ROWS[-1], 512, 1536, "int8")}


def _operands(shape: MatmulShape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if shape.dtype == "fp16":
        return (rng.standard_normal((shape.m, shape.k)).astype(np.float16),
                rng.standard_normal((shape.k, shape.n)).astype(np.float16))
    return (rng.integers(-128, 128, (shape.m, shape.k), dtype=np.int8),
            rng.integers(-128, 128, (shape.k, shape.n), dtype=np.int8))


def _median_us(fn: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def time_shape(runtime: Any, shape: MatmulShape, runs: int, warm: int = 2) -> dict[str, Any]:
    """One shape's figures on core 0, domain 0."""
    ctx = runtime.context(shape)
    try:
        a, b = _operands(shape, np.random.default_rng(0))
        held = ctx.new_b()
        t0 = time.perf_counter()
        ctx.write_b(held, b)
        write_us = 1e6 * (time.perf_counter() - t0)
        for _ in range(warm):
            ctx.run(a, held)
        run_us = _median_us(lambda: ctx.run(a, held), runs)
        npu_us = _median_us(ctx.rerun, runs)
    finally:
        ctx.close()
    return {"shape": str(shape), "us_per_run": run_us, "gops": shape.flops / run_us / 1e3,
            "npu_us_per_run": npu_us, "npu_gops": shape.flops / npu_us / 1e3,
            "write_b_us": write_us}


def time_dynamic(runtime: Any, shape: MatmulShape, rows: tuple[int, ...], runs: int,
                 warm: int = 2) -> dict[int, dict[str, Any]]:
    """Per declared M, the figures of ``time_shape`` from one dynamic context and one B
    (core 0, domain 0); the smallest M's also carries ``switch_us_per_run``."""
    ctx = runtime.context(shape, rows=rows)
    try:
        a, b = _operands(shape, np.random.default_rng(0))
        held = ctx.new_b()
        ctx.write_b(held, b)
        figures: dict[int, dict[str, Any]] = {}
        for m in rows:
            part = a[:m]
            for _ in range(warm):
                ctx.run(part, held)
            run_us = _median_us(lambda part=part: ctx.run(part, held), runs)
            npu_us = _median_us(ctx.rerun, runs)  # at the M of the last run: m
            flops = replace(shape, m=m).flops
            figures[m] = {"shape": f"{replace(shape, m=m)} (dynamic, M in {rows})",
                          "us_per_run": run_us, "gops": flops / run_us / 1e3,
                          "npu_us_per_run": npu_us, "npu_gops": flops / npu_us / 1e3}
        # the smallest M's run right after one at the largest: its us_per_run plus the
        # shape change (set_dynamic_shape, A and C set again)
        small, large = a[:rows[0]], a[:rows[-1]]
        times = []
        for _ in range(runs):
            ctx.run(large, held)
            t0 = time.perf_counter()
            ctx.run(small, held)
            times.append(time.perf_counter() - t0)
        figures[rows[0]]["switch_us_per_run"] = 1e6 * statistics.median(times)
        figures[rows[0]]["switch_from_m"] = rows[-1]
    finally:
        ctx.close()
    return figures


def measure(runs: int) -> dict[str, Any]:
    """Every plan shape, each either its figures or the error that stopped it."""
    try:
        runtime = open_runtime()
    except MatmulError as exc:
        return {"runtime": None, "error": str(exc), "shapes": {}}
    shapes: dict[str, Any] = {}
    dynamic: dict[str, Any] = {}
    try:
        for name, shape in plan_shapes().items():
            try:
                shapes[name] = time_shape(runtime, shape, runs)
            except MatmulError as exc:
                shapes[name] = {"shape": str(shape), "error": str(exc)}
        for name, shape in dynamic_shapes().items():
            rows = tuple(m for m in EXPERT_ROWS if m <= shape.m)
            try:
                for m, figure in time_dynamic(runtime, shape, rows, runs).items():
                    dynamic[f"{name}_m{m}"] = figure
            except MatmulError as exc:
                dynamic[name] = {"shape": f"{shape} (dynamic, M in {rows})", "error": str(exc)}
    finally:
        runtime.close()
    return {"runtime": runtime.name, "runs": runs, "shapes": shapes, "dynamic": dynamic}


def summary_lines(figures: dict[str, Any] | None) -> list[str]:
    """The report summary's lines for these figures."""
    if not figures:
        return []
    if figures.get("runtime") is None:
        return [f"NPU matmuls: not measured ({figures.get('error')})"]
    note = "" if figures["runtime"] == "librknnrt" else " (host stand-in: not NPU figures)"
    lines = [f"NPU matmuls on {figures['runtime']}{note}: us per run / GOPS (library call "
             "alone)"]
    lines += [_line(name, f) for name, f in figures["shapes"].items()]
    dynamic = figures.get("dynamic") or {}
    if dynamic:
        lines.append("  experts through one dynamic-M context per projection (one B, "
                     "rknn_matmul_set_dynamic_shape):")
        for name, f in dynamic.items():
            line = _line(name, {**f, "shape": f.get("shape", "").split(" (")[0]})
            if "switch_us_per_run" in f:
                line += f"; after M = {f['switch_from_m']}: {f['switch_us_per_run']:.0f} us"
            lines.append(line)
    return lines


def _line(name: str, f: dict[str, Any]) -> str:
    if "error" in f:
        return f"  {name:<20} {f['shape']:<22} failed: {f['error']}"
    return (f"  {name:<20} {f['shape']:<22} {f['us_per_run']:>9.0f} us {f['gops']:>7.1f}  "
            f"({f['npu_us_per_run']:.0f} us {f['npu_gops']:.1f})")

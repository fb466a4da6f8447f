"""CLI glue for ``ling3-rknn bench``: check the inputs, load, measure, report.

Everything that can be wrong with the arguments (a bad ``--compare`` file, no matplotlib
for ``--plot``, a ``--threads`` the machine cannot honour, a missing bundle) is found
before measuring and is a one-line error with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ling3_rknn.bundle import Bundle, BundleError
from ling3_rknn.cpu_threads import ThreadPolicyError, apply_thread_policy
from ling3_rknn.engine import EngineError
from ling3_rknn.npu import ExpertError, NpuError

from . import compare, identity, measure, plot, report
from .progress import Progress


def _fail(message: str) -> int:
    print(f"ling3-rknn bench: {message}", file=sys.stderr)
    return 2


def _load_engine(args: argparse.Namespace) -> Any:
    """The engine as ``serve`` builds it (the demo when no ``--bundle``)."""
    from ling3_rknn.loading import LoadOptions, engine_from_bundle

    options = LoadOptions(npu_prefill=getattr(args, "npu_prefill", "auto"))
    if args.bundle is None:
        from ling3_rknn.demo import load_demo_engine

        return load_demo_engine(options)
    return engine_from_bundle(args.bundle, options)


def run_bench(args: argparse.Namespace) -> int:
    old = None
    try:
        if args.compare is not None:
            old = compare.load_report(args.compare)
        if args.plot is not None:
            plot.require_matplotlib()
        policy = apply_thread_policy(args.threads)  # before any pool starts, as serve does
        bundle = Bundle.open(measure.bundle_root(args.bundle), verify="size")
    except (compare.CompareError, plot.PlotUnavailable, ThreadPolicyError, BundleError) as exc:
        return _fail(str(exc))

    plan = measure.make_plan(args.quick)
    progress = Progress(total=6 + len(plan.sizes))
    progress.step(f"load {bundle.root.name}")
    t0 = time.perf_counter()
    try:
        engine = _load_engine(args)
    except (BundleError, NpuError, ExpertError, OSError, ValueError) as exc:
        progress.close()
        return _fail(f"cannot load the model: {exc}")
    load_s = time.perf_counter() - t0
    try:
        figures = measure.measure(engine, bundle, plan, progress)
    except (EngineError, NpuError, ExpertError) as exc:  # the model failed mid-run
        print(f"ling3-rknn bench: the model failed while measuring: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()
        progress.close()
    result = report.build_report(
        figures, executor=identity.executor_kind(bundle), machine=identity.machine(policy),
        bundle=identity.bundle_identity(bundle, engine.model_id), quick=args.quick,
        load_s=load_s, rss=identity.rss_bytes(),
        npu_resident_bytes=identity.npu_resident_bytes(bundle),
        memory=identity.memory_sizes(engine.memory_plan))
    report.write_report(result, args.json)
    print(report.summary(result))
    print(f"report: {args.json}")
    if args.plot is not None:
        plot.write_plot(result, args.plot)
        print(f"plot: {args.plot}")
    if old is not None:
        print(f"\nagainst {args.compare} (new/old):")
        print(compare.format_ratios(compare.ratios(result, old)))
    return 0

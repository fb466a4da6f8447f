"""Board-side setup check and NPU latency benchmark for a converted bundle (RK3588).

    python board/check.py BUNDLE_DIR [--empty-rknn FILE] [--runs 50] [--json out.json]

1. ``rknnlite`` imports (rknn-toolkit-lite2) and reports its runtime (librknnrt) version;
   the NPU kernel driver version is read from debugfs / sysfs when readable.
2. The bundle's manifest is verified (sizes; ``--full`` for sha256) and every ``.rknn``
   graph is loaded with ``RknnLiteExecutor`` on the cores its placement plan names.
3. Latency: an empty graph (``--empty-rknn``, e.g. one Add built on the host with
   ``convert.rknn_toolkit.build_rknn``) gives the fixed per-call cost; then every stage
   at T = 1 (decode) and at the prefill chunk, median and p90 over ``--runs`` calls, and
   the sum over one token's dense stages (the NPU floor of a decode step).

Not run in this repository's CI: it needs the board. Written against rknn-toolkit-lite2
2.5.0's documented API (the same one ``ling3_rknn.npu.RknnLiteExecutor`` drives and the
host mock imitates); untested on hardware so far. Exit status 1 on any failed check.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

DRIVER_VERSION_FILES = ("/sys/kernel/debug/rknpu/version", "/sys/module/rknpu/version",
                        "/proc/rknpu/version")


def driver_version() -> str | None:
    for path in DRIVER_VERSION_FILES:
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return None


def latency(run, feeds: list[np.ndarray], runs: int) -> tuple[float, float]:
    run(*feeds)  # warm-up: first call allocates
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run(*feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--empty-rknn", type=Path)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--full", action="store_true", help="verify sha256 of every file")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    report: dict = {"machine": platform.machine()}
    ok = True

    try:
        from rknnlite.api import RKNNLite
    except ImportError as exc:
        print(f"FAIL rknnlite import: {exc} (pip install rknn-toolkit-lite2; librknnrt.so "
              "in /usr/lib)")
        return 1
    print("ok   rknnlite imports")
    report["driver"] = driver_version()
    print(f"{'ok  ' if report['driver'] else 'warn'} NPU driver: "
          f"{report['driver'] or 'version file not readable (try as root)'}")

    from ling3_rknn.bundle import Bundle, BundleError
    from ling3_rknn.npu import NpuError, RknnLiteExecutor

    try:
        bundle = Bundle.open(args.bundle, verify="full" if args.full else "size")
    except BundleError as exc:
        print(f"FAIL bundle: {exc}")
        return 1
    m = bundle.manifest
    if m.target != "rk3588":
        print(f"FAIL bundle target is {m.target!r}, not rk3588")
        return 1
    print(f"ok   bundle {args.bundle} ({len(m.stages)} NPU graphs, chunk {m.chunk_sizes[0]})")

    if args.empty_rknn is not None:
        lite = RKNNLite(verbose=False)
        if lite.load_rknn(str(args.empty_rknn)) != 0 or lite.init_runtime() != 0:
            print("FAIL empty graph did not load")
            ok = False
        else:
            report["sdk"] = lite.get_sdk_version()
            print(f"ok   runtime: {report['sdk']}")
            shape = [1, 1, 8]  # the documented empty graph: one Add over [1, 1, 8]
            med, p90 = latency(lambda x: lite.inference(inputs=[x]),
                               [np.zeros(shape, np.float32)], args.runs)
            report["empty_ms"] = med
            print(f"     empty graph: {med:.3f} ms median, {p90:.3f} ms p90 per call")
            lite.release()

    stages: dict[str, dict] = {}
    for name, spec in m.stages.items():
        core = m.placement.stage_cores.get(name, "auto")
        try:
            ex = RknnLiteExecutor(bundle.path(spec.rknn), spec, core_mask=core,
                                  rknnlite_cls=RKNNLite)
        except NpuError as exc:
            print(f"FAIL {name}: {exc}")
            ok = False
            continue
        row = {"core": core, "bytes": spec.nbytes}
        dtype = np.float16 if spec.input_dtype == "float16" else np.float32
        for group in spec.shape_sets:
            feeds = [np.random.default_rng(0).normal(size=s).astype(dtype) for s in group]
            med, p90 = latency(ex.run, feeds, args.runs)
            row[f"T={group[0][1]}"] = {"median_ms": med, "p90_ms": p90}
        ex.close()
        stages[name] = row
        print(f"ok   {name:<22} core {core:<5} " + "  ".join(
            f"{k}: {v['median_ms']:.2f} ms" for k, v in row.items() if k.startswith("T=")))
    dense = [r["T=1"]["median_ms"] for n, r in stages.items() if ".expert." not in n]
    if dense:
        print(f"     decode NPU floor: {len(dense)} calls, {sum(dense):.1f} ms per token")
    report["stages"] = stages
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

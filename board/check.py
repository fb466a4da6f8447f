"""Board-side setup check and NPU latency benchmark for a converted bundle (RK3588).

    python board/check.py [BUNDLE_DIR] [--empty-rknn FILE] [--runs 50] [--full]
                          [--json out.json] [--mock]

With no BUNDLE_DIR it checks the embedded demo bundle (``ling3_rknn/demo/bundle``): a
new board's first smoke test needs nothing but the package.

1. ``rknnlite`` imports (rknn-toolkit-lite2); the NPU kernel driver version is read from
   debugfs / sysfs / procfs when readable.
2. The bundle's manifest is verified (sizes; ``--full`` for sha256) and every ``.rknn``
   graph is loaded with ``RknnLiteExecutor`` on the cores its placement plan names.
3. Latency: an empty graph (``--empty-rknn``, one Add over ``[1, 1, 8]`` built on the host
   with ``convert.rknn_toolkit.build_rknn``) gives the fixed per-call cost and the runtime
   (librknnrt) version; then every stage at T = 1 (decode) and at the prefill chunk, median
   and p90 over ``--runs`` calls, and the sum over one token's dense stages (the NPU floor
   of a decode step).

``--mock`` swaps ``rknnlite`` for ``ling3_rknn.npu.MockRKNNLite`` (the ONNX twin next to
each ``.rknn`` on onnxruntime) and skips the driver line; everything else is the same
code, which is how CI runs this script on the host (tests/test_board_check.py). Mock
latencies are the host CPU's, not the NPU's. Without ``--mock`` the script needs nothing
beyond the runtime's own dependencies (no ``onnx`` package).

Exit status 0 when every check passed, 1 otherwise; ``--json`` writes the report either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _import_project() -> None:
    """Let ``python board/check.py`` run from a source checkout without an install."""
    try:
        import ling3_rknn  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


_import_project()
# The shared pieces live in the doctor (``ling3-rknn doctor``), which runs the same
# checks without the latency options; this script stays for --empty-rknn and --json OUT.
from ling3_rknn.doctor.board import DRIVER_VERSION_FILES  # noqa: E402
from ling3_rknn.doctor.graphs import NPU_WINDOW_BYTES, latency  # noqa: E402
from ling3_rknn.doctor.graphs import starts_with as _starts_with  # noqa: E402
from ling3_rknn.doctor.sysfs import SysRoot  # noqa: E402

EMPTY_GRAPH_SHAPE = (1, 1, 8)  # the documented empty graph: one Add over [1, 1, 8]


def driver_version() -> str | None:
    return next(filter(None, map(SysRoot().read, DRIVER_VERSION_FILES)), None)


class Checker:
    """Runs the checks in order; each failure is printed as a ``FAIL`` line and kept."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.failures: list[str] = []
        self.report: dict[str, Any] = {
            "machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "runtime": "mock" if args.mock else "rknnlite",
            "bundle": str(args.bundle), "runs": args.runs}

    def fail(self, what: str) -> None:
        print(f"FAIL {what}", flush=True)
        self.failures.append(what)

    def runtime(self) -> type | None:
        """The ``RKNNLite`` class: the board's, or the mock with ``--mock``."""
        if self.args.mock:
            from ling3_rknn.npu import MockRKNNLite

            print("ok   runtime: MockRKNNLite (--mock: ONNX twins on onnxruntime, host CPU "
                  "latencies, not the NPU's)")
            print("skip NPU driver version: --mock, no NPU")
            self.report["driver"] = None
            return MockRKNNLite
        try:
            from rknnlite.api import RKNNLite
        except ImportError as exc:
            self.fail(f"rknnlite import: {exc} (pip install rknn-toolkit-lite2; librknnrt.so "
                      "in /usr/lib; on a host without NPU use --mock)")
            return None
        print("ok   rknnlite imports")
        driver = driver_version()
        self.report["driver"] = driver
        print(f"{'ok  ' if driver else 'warn'} NPU driver: "
              f"{driver or 'version file not readable (try as root)'}")
        return RKNNLite

    def open_bundle(self) -> Any:
        from ling3_rknn.bundle import Bundle, BundleError

        try:
            bundle = Bundle.open(self.args.bundle, verify="full" if self.args.full else "size")
        except BundleError as exc:
            self.fail(f"bundle: {exc}")
            return None
        m = bundle.manifest
        if m.target != "rk3588":
            self.fail(f"bundle target is {m.target!r}, not rk3588 (a --target cpu bundle has "
                      "no .rknn graphs)")
            return None
        npu_bytes = sum(s.nbytes for s in m.stages.values())
        self.report.update(target=m.target, chunk=m.chunk_sizes[0], npu_bytes=npu_bytes,
                           verified="sha256" if self.args.full else "size")
        print(f"ok   bundle {self.args.bundle} ({len(m.stages)} NPU graphs, chunk "
              f"{m.chunk_sizes[0]}, {npu_bytes / 2**20:.1f} MiB of the ~4 GiB NPU window, "
              f"files checked by {'sha256' if self.args.full else 'size'})")
        if npu_bytes > NPU_WINDOW_BYTES:
            self.fail(f"NPU graphs take {npu_bytes / 2**30:.2f} GiB, more than the ~4 GiB "
                      "window RKNNLite models share")
        return bundle

    def empty_graph(self, rknnlite_cls: type) -> None:
        path = self.args.empty_rknn
        lite = rknnlite_cls(verbose=False)
        try:
            if lite.load_rknn(str(path)) != 0 or lite.init_runtime() != 0:
                self.fail(f"empty graph {path} did not load (see the RKNNLite log above)")
                return
            self.report["sdk"] = lite.get_sdk_version()
            print(f"ok   runtime version: {self.report['sdk']}")

            def call(x: np.ndarray) -> None:
                if lite.inference(inputs=[x]) is None:
                    raise RuntimeError("inference returned None (see the RKNNLite log)")

            try:
                med, p90 = latency(call, [np.zeros(EMPTY_GRAPH_SHAPE, np.float32)],
                                   self.args.runs)
            except RuntimeError as exc:
                self.fail(f"empty graph {path}: {exc}; it must take one "
                          f"{list(EMPTY_GRAPH_SHAPE)} input")
                return
            self.report["empty_ms"] = {"median_ms": med, "p90_ms": p90}
            print(f"ok   empty graph: {med:.3f} ms median, {p90:.3f} ms p90 per call")
        finally:
            lite.release()

    def stages(self, bundle: Any, rknnlite_cls: type) -> None:
        from ling3_rknn.bundle import PLACEHOLDER_MAGIC
        from ling3_rknn.npu import NpuError, RknnLiteExecutor

        m = bundle.manifest
        rows: dict[str, dict[str, Any]] = {}
        for name, spec in m.stages.items():
            core = m.placement.stage_cores.get(name, "auto")
            if spec.rknn is None:
                self.fail(f"{name}: the manifest names no .rknn file")
                continue
            path = bundle.path(spec.rknn)
            if not self.args.mock and _starts_with(path, PLACEHOLDER_MAGIC):
                self.fail(f"{name}: {spec.rknn} is a placeholder from a conversion without "
                          "rknn-toolkit2; re-convert with the toolkit for the board")
                continue
            try:
                ex = RknnLiteExecutor(path, spec, core_mask=core, rknnlite_cls=rknnlite_cls)
            except NpuError as exc:
                self.fail(f"{name}: {exc}")
                continue
            row: dict[str, Any] = {"core": core, "bytes": spec.nbytes}
            dtype = np.float16 if spec.input_dtype == "float16" else np.float32
            try:
                for group in spec.shape_sets:
                    rng = np.random.default_rng(0)
                    feeds = [rng.normal(size=s).astype(dtype) for s in group]
                    med, p90 = latency(ex.run, feeds, self.args.runs)
                    row[f"T={group[0][1]}"] = {"median_ms": med, "p90_ms": p90}
            except NpuError as exc:
                self.fail(f"{name}: {exc}")
                continue
            finally:
                ex.close()
            rows[name] = row
            print(f"ok   {name:<22} core {core:<5} " + "  ".join(
                f"{k}: {v['median_ms']:.2f} ms" for k, v in row.items() if k.startswith("T=")))
        self.report["stages"] = rows
        dense = [r["T=1"]["median_ms"] for n, r in rows.items()
                 if ".expert." not in n and "T=1" in r]
        if dense:
            floor = sum(dense)
            self.report["decode_floor"] = {"calls": len(dense), "ms_per_token": floor}
            print(f"     decode NPU floor: {len(dense)} calls, {floor:.1f} ms per token"
                  + (" (host CPU, --mock)" if self.args.mock else ""))

    def run(self) -> None:
        rknnlite_cls = self.runtime()
        if rknnlite_cls is None:
            return
        bundle = self.open_bundle()
        if bundle is None:
            return
        if self.args.empty_rknn is not None:
            self.empty_graph(rknnlite_cls)
        self.stages(bundle, rknnlite_cls)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Atomic: a reader never sees half a report."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        return value

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?",
                    help="bundle to check (default: the embedded demo bundle)")
    ap.add_argument("--empty-rknn", type=Path,
                    help=f"an .rknn of one Add over {list(EMPTY_GRAPH_SHAPE)}: per-call cost")
    ap.add_argument("--runs", type=positive, default=50, help="timed calls per shape")
    ap.add_argument("--full", action="store_true", help="verify sha256 of every file")
    ap.add_argument("--json", type=Path, help="write the report here (also on failure)")
    ap.add_argument("--mock", action="store_true",
                    help="host run: MockRKNNLite (ONNX twins) instead of rknnlite")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bundle is None:
        from ling3_rknn.demo import bundle_dir

        args.bundle = bundle_dir()
    checker = Checker(args)
    checker.run()
    checker.report.update(ok=not checker.failures, failures=checker.failures)
    if args.json is not None:
        try:
            write_json(args.json, checker.report)
        except OSError as exc:
            print(f"FAIL json report {args.json}: {exc}")
            return 1
    return 0 if not checker.failures else 1


if __name__ == "__main__":
    sys.exit(main())

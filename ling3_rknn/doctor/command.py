"""``ling3-rknn doctor``: run every check, print the report, exit 0 when ready.

Every check runs inside :func:`_guarded`, so a check that crashes (an odd kernel, a
permission error) becomes one failed finding rather than a traceback: the unit runs this
as ``ExecStartPre`` and its output is what the operator sees in the journal.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

from ling3_rknn.doctor import board, graphs, host
from ling3_rknn.doctor.report import Check, Report
from ling3_rknn.doctor.sysfs import SysRoot

ROOT_ENV = "LING3_RKNN_DOCTOR_ROOT"  # a fake board's filesystem root (tests, demos)
LATENCY_RUNS = 10


def _guarded(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    try:
        found = fn()
    except Exception as exc:  # a check must never end the run with a traceback
        return [Check(name, "fail", f"check crashed: {type(exc).__name__}: {exc}")]
    return found if isinstance(found, list) else [found]


def _machine(sys_root: SysRoot) -> dict[str, object]:
    return {"arch": platform.machine(), "kernel": platform.release(),
            "python": platform.python_version(),
            "model": sys_root.read("proc/device-tree/model")}


def _rknnlite_class(on_board: bool) -> type | None:
    if not on_board:
        from ling3_rknn.npu import MockRKNNLite

        return MockRKNNLite
    try:
        from rknnlite.api import RKNNLite
    except ImportError:
        return None
    return RKNNLite


def diagnose(bundle_path: Path, quick: bool, sys_root: SysRoot, *,
             runs: int = LATENCY_RUNS, full: bool = False,
             empty_rknn: Path | None = None) -> Report:
    """All findings for this machine and ``bundle_path``. Without ``quick`` every graph is
    loaded and timed over ``runs`` calls per shape; ``full`` hashes every file anew;
    ``empty_rknn`` (a one-Add graph) measures the fixed per-call cost."""
    report = Report(machine=_machine(sys_root))
    add = report.checks.extend
    on_board, soc_check = False, Check("SoC", "fail", "not checked")
    try:
        on_board, soc_check = board.soc(sys_root)
    except Exception as exc:
        soc_check = Check("SoC", "fail", f"check crashed: {type(exc).__name__}: {exc}")
    report.machine["rk3588"] = on_board
    add([soc_check])
    opened: list[graphs.Bundle | None] = [None]

    def open_bundle() -> Check:
        opened[0], found = graphs.open_bundle(bundle_path, quick, full)
        return found

    bundle_checks = _guarded("bundle", open_bundle)
    bundle = opened[0]
    if on_board:
        toolkit = bundle_checks[0].data.get("toolkit")  # what built the .rknn files
        add(_guarded("NPU driver", lambda: board.driver(sys_root)))
        add(_guarded("librknnrt", lambda: board.librknnrt(sys_root, toolkit)))
        add(_guarded("CPU governors", lambda: board.cpu_governors(sys_root)))
        add(_guarded("NPU/DDR clocks", lambda: board.npu_ddr(sys_root)))
        add(_guarded("thermal", lambda: board.thermals(sys_root)))
    add(_guarded("rknn-toolkit-lite2", lambda: host.rknnlite(on_board)))
    add(_guarded("Python packages", host.runtime_packages))
    add(_guarded("decode kernels", host.decode_kernels))
    add(bundle_checks)
    need = bundle.loaded_bytes(npu_graphs=on_board) if bundle is not None else None
    add(_guarded("memory", lambda: host.memory(
        sys_root, need, graphs.sequence_bytes(bundle) if bundle is not None else 0,
        bundle.manifest.npu_matmul_expert_bytes() if bundle is not None else 0)))
    if bundle is None or quick:
        add([Check("graphs", "skip", "--quick" if quick else "no bundle")])
        return report
    cls = _rknnlite_class(on_board)
    if cls is None:
        add([Check("graphs", "skip", "rknnlite does not import (see rknn-toolkit-lite2)")])
        return report
    if empty_rknn is not None:
        add(_guarded("empty graph", lambda: graphs.empty_graph(empty_rknn, cls, runs)))
    add(_guarded("graphs", lambda: graphs.load_graphs(bundle, cls, on_board, runs)))
    return report


def run_doctor(args: argparse.Namespace, root: Path | None = None) -> int:
    """Print the report (text or ``--json``); 0 when the board is ready, 1 when not."""
    if root is None:
        root = Path(os.environ.get(ROOT_ENV) or "/")
    bundle_path = args.bundle
    if bundle_path is None:
        from ling3_rknn.demo import bundle_dir

        bundle_path = bundle_dir()
    report = diagnose(Path(bundle_path), args.quick, SysRoot(root), runs=args.runs or LATENCY_RUNS,
                      full=args.full, empty_rknn=args.empty_rknn)
    print(report.to_json() if args.json else report.to_text(), flush=True)
    if not args.json and not report.ready:
        print("ling3-rknn doctor: the board is not ready (fixes above)", file=sys.stderr)
    return 0 if report.ready else 1

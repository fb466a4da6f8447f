"""What a report was measured on: the machine, the bundle, the executor, the memory.

Reports are compared across boards and releases, so each one says which machine (and
whether it is an RK3588), which bundle (by manifest hash) and which executor ran it:
figures from the host mock and from the NPU must never be mistaken for each other.
"""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any

from ling3_rknn.bundle import Bundle
from ling3_rknn.cpu_threads import ThreadPolicy, is_rk3588
from ling3_rknn.memory_plan import MemoryPlan
from ling3_rknn.npu import MockRKNNLite, resolve_rknnlite


def cpu_model() -> str:
    """The CPU (x86: ``model name``) or board (ARM: device-tree ``model``) name."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Model") and value.strip():
                return value.strip()
    except OSError:
        pass
    try:
        return Path("/proc/device-tree/model").read_text(errors="replace").strip("\x00\n ")
    except OSError:
        return platform.processor() or platform.machine()


def machine(policy: ThreadPolicy) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "is_rk3588": is_rk3588(),
        "threads": policy.threads,
        "thread_cpus": list(policy.cpus),
    }


def executor_kind(bundle: Bundle) -> str:
    """``rknnlite`` (the board runtime), ``mock`` (its ONNX-twin stand-in) or ``onnx`` (a
    ``--target cpu`` bundle): the same choice ``Model.from_bundle`` makes by default."""
    if bundle.manifest.target == "cpu":
        return "onnx"
    return "mock" if resolve_rknnlite() is MockRKNNLite else "rknnlite"


def npu_resident_bytes(bundle: Bundle) -> int:
    """Bytes the stage graphs hold in NPU memory (manifest ``nbytes`` of every ``.rknn``)."""
    if bundle.manifest.target == "cpu":
        return 0
    return sum(s.nbytes for s in bundle.manifest.stages.values() if s.rknn is not None)


def bundle_identity(bundle: Bundle, model_id: str) -> dict[str, Any]:
    manifest = bundle.manifest
    return {
        "path": str(bundle.root.resolve()),
        "manifest_sha256": hashlib.sha256((bundle.root / "manifest.json").read_bytes())
        .hexdigest(),
        "target": manifest.target,
        "model_id": model_id,
        "stages": len(manifest.stages),
        "experts": manifest.experts.format if manifest.experts is not None else None,
    }


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
                return current, max(peak, current)  # read a moment apart
    except OSError:
        pass
    return peak, peak


def memory_sizes(plan: MemoryPlan | None) -> dict[str, int | None] | None:
    """The sizes the engine ran with: a prefill past the scratch runs in the slower absorbed
    form, so a report from a machine with less spare memory says why."""
    if plan is None:
        return None
    return {"cache_bytes": plan.cache_bytes, "prefill_scratch_bytes": plan.prefill_scratch_bytes,
            "spare_bytes": plan.spare_bytes, "total_bytes": plan.total_bytes}

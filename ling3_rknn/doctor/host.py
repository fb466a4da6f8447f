"""Checks that mean the same on any machine: Python packages and memory."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from ling3_rknn.doctor.report import Check
from ling3_rknn.doctor.sysfs import SysRoot
from ling3_rknn.engine.options import DEFAULT_CACHE_BYTES
from ling3_rknn.memory_plan import (
    capped_by_cgroup,
    cgroup_memory,
    choose_npu_experts,
    parse_meminfo,
    plan_memory,
)
from ling3_rknn.model import native, native_build
from ling3_rknn.model.mla_expanded import PREFILL_SCRATCH_BYTES

MEMINFO = "proc/meminfo"


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def rknnlite(on_board: bool) -> Check:
    """rknn-toolkit-lite2: required on the board; a host runs the onnxruntime mock."""
    version = package_version("rknn-toolkit-lite2")
    if version is not None:
        return Check("rknn-toolkit-lite2", "ok", version, data={"version": version})
    if not on_board:
        return Check("rknn-toolkit-lite2", "skip", "not installed (host: the onnxruntime "
                     "mock runs the graphs)")
    return Check("rknn-toolkit-lite2", "fail", "not installed",
                 fix="pip install 'ling3-rknn[board]'  # in the service's venv, "
                     "e.g. /opt/ling3-rknn/.venv/bin/pip")


def runtime_packages() -> Check:
    names = ("ling3-rknn", "numpy", "onnxruntime", "tokenizers", "aiohttp")
    versions = {n: package_version(n) for n in names}
    missing = [n for n, v in versions.items() if v is None and n != "ling3-rknn"]
    shown = ", ".join(f"{n} {v}" for n, v in versions.items() if v)
    detail = f"Python {platform.python_version()}; {shown}"
    if missing:
        return Check("Python packages", "fail", f"{detail}; missing {', '.join(missing)}",
                     fix="pip install 'ling3-rknn[board]'", data={"versions": versions})
    return Check("Python packages", "ok", detail, data={"versions": versions})


def decode_kernels() -> Check:
    """Which decode glue runs: the compiled kernels this install built (``ling3-rknn
    build-kernels``), with their path and instruction set, or numpy and why (correct,
    slower). doctor only looks: building is the install's job, never the service's."""
    detail = native.status()
    if native.available():
        return Check("decode kernels", "ok", detail, data={"library": str(native.library_path())})
    if os.environ.get(native.NATIVE_ENV) == "0":
        return Check("decode kernels", "skip", detail)
    build = f"{Path(sys.prefix) / 'bin' / 'ling3-rknn'} build-kernels"
    if native_build.compiler() is None:
        build = f"sudo apt install gcc && {build}"
    return Check("decode kernels", "warn", detail,
                 fix=f"{build}  # as the user that installed the venv; then restart the service")


def meminfo(sys: SysRoot) -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    return parse_meminfo(sys.read(MEMINFO) or "")


def memory(sys: SysRoot, need: int | None, sequence: int = 0, npu_copy: int = 0) -> Check:
    """Total memory must hold the bundle; available memory below it means paging. With a
    bundle, also what ``serve`` will give the prefix cache and the prefill scratch at its
    defaults (``memory_plan``; ``sequence``: one sequence's state at the default context),
    and whether it loads the routed experts' int8 copy for the NPU (``npu_copy`` bytes, not
    in ``need``)."""
    # In the unit's ExecStartPre the doctor shares the service's cgroup, so its MemoryMax=
    # caps these figures as it will cap serve's.
    limited = cgroup_memory(sys.path("proc/self/cgroup"), sys.path("sys/fs/cgroup"))
    info = capped_by_cgroup(meminfo(sys), limited)
    total, avail = info.get("MemTotal"), info.get("MemAvailable")
    if total is None or avail is None:
        return Check("memory", "warn", f"{SysRoot.shown(MEMINFO)} not readable")
    gib = 2**30
    data: dict[str, object] = {"total_bytes": total, "available_bytes": avail,
                               "bundle_bytes": need,
                               "cgroup_limit_bytes": limited[0] if limited else None}
    detail = f"{avail / gib:.1f} GiB available of {total / gib:.1f} GiB"
    capped = limited is not None and limited[0] == total
    if capped:
        detail += " (this process's cgroup limit)"
    if need is None:
        return Check("memory", "ok", detail, data=data)
    detail += f"; the bundle takes {need / gib:.2f} GiB"
    if need > total:
        if capped:
            return Check("memory", "fail", detail + ": more than the cgroup allows",
                         fix="raise MemoryMax= (systemctl edit ling3-rknn) or the container's "
                             "memory limit", data=data)
        return Check("memory", "fail", detail + ": more than the board has",
                     fix="use a board with more memory (16 GB or 32 GB CM3588), or a smaller "
                         "conversion (--experts int4)", data=data)
    if need > avail:
        return Check("memory", "warn", detail + ": more than is free now, expect paging",
                     fix="stop other services (free -h; systemctl list-units --type=service)",
                     data=data)
    # doctor runs before the service loads the model: what will be left once it has
    npu = choose_npu_experts(copy_bytes=npu_copy, model_bytes=need, sequence_bytes=sequence,
                             meminfo=info)
    model = need + (npu.copy_bytes if npu.taken else 0)
    loaded = {"MemTotal": total, "MemAvailable": max(0, avail - model)}
    plan = plan_memory(model_bytes=model, sequence_bytes=sequence, meminfo=loaded,
                       cache_bytes=None, prefill_scratch_bytes=None,
                       default_cache_bytes=DEFAULT_CACHE_BYTES,
                       default_prefill_scratch_bytes=PREFILL_SCRATCH_BYTES)
    data.update(cache_bytes=plan.cache_bytes, prefill_scratch_bytes=plan.prefill_scratch_bytes,
                npu_experts_bytes=npu.copy_bytes, npu_experts_taken=npu.taken)
    detail += (f"; serve at its defaults (auto sizes, float32 latents, a 32K context) will "
               f"give the prefix cache {plan.cache_bytes / gib:.2f} GiB and the prefill "
               f"scratch {plan.prefill_scratch_bytes / gib:.2f} GiB")
    if npu.copy_bytes:
        detail += (f"; the routed experts' int8 copy for the NPU ({npu.copy_bytes / gib:.2f} "
                   f"GiB) {'is' if npu.taken else 'is not'} loaded ({npu.reason})")
    warnings = plan.warnings()
    if warnings:
        return Check("memory", "warn", f"{detail}: {'; '.join(warnings)}",
                     fix="serve --latent-cache float16 (half the per-sequence memory), a "
                         "smaller --max-context, or stop other services", data=data)
    return Check("memory", "ok", detail, data=data)

"""The board-only parts of the runtime on aarch64 (the aarch64 tier, tests/aarch64/run.sh):
``ling3-rknn doctor --json`` on the fake CM3588 of tests/test_doctor.py with the real
rknn-toolkit-lite2 wheel installed, the thread policy on an RK3588's core layout, and the
real ``rknnlite`` binding without Rockchip's ``librknnrt.so`` (no NPU under emulation).
Skipped on any other machine: x86 has no aarch64 wheel of rknn-toolkit-lite2."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from fake_board import fake_board

from ling3_rknn.cpu_threads import ThreadPolicy, biggest_cores, is_rk3588
from ling3_rknn.demo import bundle_dir
from ling3_rknn.npu import NpuError

pytestmark = pytest.mark.skipif(platform.machine() != "aarch64",
                                reason="the aarch64 tier runs on aarch64 (tests/aarch64/run.sh)")

A55, A76 = 414, 1024  # cpu_capacity of an RK3588's cores 0-3 and 4-7


def ling3_rknn() -> str:
    return shutil.which("ling3-rknn", path=str(Path(sys.executable).parent)) or "ling3-rknn"


def test_doctor_json_on_a_fake_cm3588_with_the_real_lite2(tmp_path):
    root = fake_board(tmp_path / "board")
    done = subprocess.run([ling3_rknn(), "doctor", "--quick", "--json"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "LING3_RKNN_DOCTOR_ROOT": str(root)})
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["machine"]["arch"] == "aarch64" and report["machine"]["rk3588"] is True
    lite2 = checks["rknn-toolkit-lite2"]  # the installed wheel, not a test double
    assert lite2["status"] == "ok" and lite2["detail"] == version("rknn-toolkit-lite2")
    assert checks["decode kernels"]["status"] == "ok", checks["decode kernels"]
    assert checks["librknnrt"]["status"] == "ok"  # the fake board's file
    failed = {n: c["detail"] for n, c in checks.items() if c["status"] == "fail"}
    assert report["ready"] is True and done.returncode == 0, failed


def test_doctor_says_librknnrt_is_missing(tmp_path):
    root = fake_board(tmp_path / "board", librknnrt=None)
    done = subprocess.run([ling3_rknn(), "doctor", "--quick", "--json"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "LING3_RKNN_DOCTOR_ROOT": str(root)})
    report = json.loads(done.stdout)
    check = next(c for c in report["checks"] if c["name"] == "librknnrt")
    assert done.returncode == 1 and check["status"] == "fail"
    assert "librknnrt.so" in check["detail"] and "/usr/lib/" in check["fix"]


def test_thread_policy_takes_the_a76_cores(tmp_path):
    sys_cpu = tmp_path / "cpu"
    for cpu, capacity in enumerate([A55] * 4 + [A76] * 4):
        (sys_cpu / f"cpu{cpu}").mkdir(parents=True)
        (sys_cpu / f"cpu{cpu}" / "cpu_capacity").write_text(f"{capacity}\n")
    assert biggest_cores(list(range(8)), sys_cpu) == [4, 5, 6, 7]
    policy = ThreadPolicy.resolve(cpus=list(range(8)), sys_cpu=sys_cpu)
    assert policy.threads == 4 and policy.cpus == (4, 5, 6, 7)
    root = fake_board(tmp_path / "board")
    assert is_rk3588(root / "proc/device-tree/compatible")


def test_the_real_rknnlite_imports():
    from rknnlite.api import RKNNLite

    assert callable(RKNNLite.init_runtime)


@pytest.mark.skipif(Path("/usr/lib/librknnrt.so").exists(),
                    reason="librknnrt.so is installed: this checks its absence")
def test_without_librknnrt_the_runtime_says_so(monkeypatch):
    """The demo bundle on the real binding: its .rknn graphs load into RKNNLite, whose
    runtime then needs librknnrt.so; the error names the file and where it goes."""
    from ling3_rknn.bundle import Bundle
    from ling3_rknn.model.bundle_loader import load_bundle_parts

    monkeypatch.delenv("LING3_NPU_RUNTIME", raising=False)
    with pytest.raises(NpuError) as caught:
        load_bundle_parts(Bundle.open(bundle_dir(), verify="size"), "rknnlite")
    assert "librknnrt.so" in str(caught.value) and "/usr/lib" in str(caught.value)

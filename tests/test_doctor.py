"""``ling3-rknn doctor`` against a fake RK3588 filesystem tree and on this host.

The fake tree has what the doctor reads on a CM3588: the device tree, the rknpu version,
cpufreq policies, the NPU and DDR devfreq nodes, thermal zones, meminfo and librknnrt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from fake_board import GIB_KB, fake_board

from ling3_rknn import cli
from ling3_rknn.doctor import SysRoot, board, diagnose, host, run_doctor
from ling3_rknn.doctor.report import Check, Report
from ling3_rknn.model import native, native_build


@pytest.fixture
def lite2_installed(monkeypatch):
    """rknn-toolkit-lite2 'installed': the fake board has it; this host does not."""
    real = host.package_version
    monkeypatch.setattr(host, "package_version",
                        lambda name: "2.5.0" if name == "rknn-toolkit-lite2" else real(name))


def doctor(argv: list[str], root: Path) -> int:
    args = cli.build_parser().parse_args(["doctor", *argv])
    return run_doctor(args, root=root)


def by_name(report: Report) -> dict[str, Check]:
    return {c.name: c for c in report.checks}


def test_good_fake_board_is_ready(tmp_path, lite2_installed, capsys):
    assert doctor(["--quick"], fake_board(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "ok   SoC: friendlyelec,cm3588, rockchip,rk3588" in out
    assert "v0.9.8" in out and "librknnrt: 2.5.0" in out
    assert "governor performance; 2352 MHz of 2352 MHz" in out
    assert "skip graphs: --quick" in out
    assert out.rstrip().endswith("ready") and "FAIL" not in out


def test_bad_governor_prints_the_fix_and_exits_1(tmp_path, lite2_installed, capsys):
    root = fake_board(tmp_path, cpu_governor="schedutil", npu="simple_ondemand")
    assert doctor(["--quick"], root) == 1
    out = capsys.readouterr().out
    assert "FAIL CPU policy4 (cpus 4 5): governor schedutil (want performance)" in out
    assert ("fix: echo performance | sudo tee "
            "/sys/devices/system/cpu/cpufreq/policy4/scaling_governor") in out
    assert "fix: echo performance | sudo tee /sys/class/devfreq/fdab0000.npu/governor" in out
    assert str(tmp_path) not in out  # fixes name the board's real paths
    assert "not ready: 4 problem(s)" in out


def test_board_problems_each_with_a_fix(tmp_path, lite2_installed):
    root = fake_board(tmp_path, ddr=None, driver="RKNPU driver: v0.8.2", temp_milli=85500,
                      librknnrt=None, mem_kb=4 * GIB_KB)
    found = by_name(diagnose(Path(cli_demo_bundle()), True, SysRoot(root)))
    assert found["NPU driver"].status == "warn" and "0.9.6" in found["NPU driver"].fix
    assert found["librknnrt"].status == "fail"
    assert "rknpu2/runtime/Linux/librknn_api/aarch64" in found["librknnrt"].fix
    assert found["DDR clock"].status == "warn" and "dmc" in found["DDR clock"].detail
    assert found["thermal"].status == "warn" and "soc 85.5 °C" in found["thermal"].detail
    assert found["memory"].status == "ok"  # the demo bundle is tiny


def test_librknnrt_older_than_the_toolkit_fails(tmp_path):
    root = fake_board(tmp_path, librknnrt=b"librknnrt version: 2.3.2 (429f97ae6b@2025)")
    found = board.librknnrt(SysRoot(root), "2.5.0")
    assert found.status == "fail" and "Invalid RKNN model version" in found.detail
    assert board.librknnrt(SysRoot(root), None).status == "ok"


def test_missing_lite2_on_the_board_fails_with_the_pip_command(tmp_path, capsys):
    assert doctor(["--quick"], fake_board(tmp_path)) == (
        0 if host.package_version("rknn-toolkit-lite2") else 1)
    if not host.package_version("rknn-toolkit-lite2"):
        assert "pip install 'ling3-rknn[board]'" in capsys.readouterr().out


def test_decode_kernels_are_reported_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("LING3_RKNN_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("LING3_RKNN_NATIVE", raising=False)
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_status", "not loaded yet")
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    check = host.decode_kernels()
    assert check.status == "warn" and "not built" in check.detail
    assert "apt install gcc" in check.fix and "build-kernels" in check.fix
    monkeypatch.setenv("LING3_RKNN_NATIVE", "0")
    monkeypatch.setattr(native, "_loaded", False)
    assert host.decode_kernels().status == "skip"


def test_memory_against_the_bundle(tmp_path):
    root = fake_board(tmp_path, mem_kb=8 * GIB_KB)
    assert host.memory(SysRoot(root), 10 * 2**30).status == "fail"
    assert host.memory(SysRoot(root), 6 * 2**30).status == "warn"
    assert host.memory(SysRoot(root), 1 * 2**30).status == "ok"
    assert host.memory(SysRoot(tmp_path / "nothing"), 1).status == "warn"


def test_memory_says_what_serve_will_give_the_cache_and_the_scratch(tmp_path):
    root = SysRoot(fake_board(tmp_path, mem_kb=8 * GIB_KB))  # 4 GiB of it available
    gib = 2**30
    # after loading a 0.5 GiB bundle 3.5 GiB are left: 2.25 spare beside one 0.25 GiB
    # sequence and the 1 GiB reserve, halved
    roomy = host.memory(root, gib // 2, sequence=gib // 4)
    assert roomy.status == "ok", roomy.detail
    assert "prefix cache 1.12 GiB and the prefill scratch 1.12 GiB" in roomy.detail
    assert roomy.data["cache_bytes"] + roomy.data["prefill_scratch_bytes"] == 9 * gib // 4
    full = host.memory(root, gib, sequence=5 * gib // 2)  # nothing spare once loaded
    assert full.status == "warn" and full.data["cache_bytes"] == 0
    assert "cannot keep a snapshot" in full.detail and "--latent-cache float16" in full.fix


def test_memory_is_capped_by_the_services_cgroup(tmp_path):
    """In ExecStartPre the doctor runs in the unit's cgroup: its MemoryMax= is the board."""
    root = fake_board(tmp_path, mem_kb=32 * GIB_KB)
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "self" / "cgroup").write_text("0::/system.slice/ling3-rknn.service\n")
    unit = root / "sys" / "fs" / "cgroup" / "system.slice" / "ling3-rknn.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text(f"{6 * 2**30}\n")
    (unit / "memory.current").write_text(f"{2**30}\n")
    over = host.memory(SysRoot(root), 8 * 2**30)
    assert over.status == "fail" and "cgroup" in over.detail and "MemoryMax=" in over.fix
    assert over.data["total_bytes"] == 6 * 2**30
    assert over.data["available_bytes"] == 5 * 2**30
    (unit / "memory.max").write_text("max\n")  # no limit: the board's own figures
    assert host.memory(SysRoot(root), 8 * 2**30).data["cgroup_limit_bytes"] is None


def test_a_cgroup_limit_above_the_boards_memory_is_not_blamed(tmp_path):
    """MemoryMax= of 64 GiB on a 32 GiB board caps nothing: a bundle too big for the board
    is the board's fault, and raising MemoryMax= would not help."""
    root = fake_board(tmp_path, mem_kb=32 * GIB_KB)
    (root / "proc" / "self").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "self" / "cgroup").write_text("0::/system.slice/ling3-rknn.service\n")
    unit = root / "sys" / "fs" / "cgroup" / "system.slice" / "ling3-rknn.service"
    unit.mkdir(parents=True)
    (unit / "memory.max").write_text(f"{64 * 2**30}\n")
    (unit / "memory.current").write_text(f"{2**30}\n")
    over = host.memory(SysRoot(root), 40 * 2**30)
    assert over.status == "fail" and "more than the board has" in over.detail
    assert "MemoryMax=" not in (over.fix or "") and "cgroup" not in over.detail
    assert over.data["total_bytes"] == 32 * 2**30


def test_host_says_not_an_rk3588_and_checks_the_bundle(tmp_path, capsys):
    assert doctor([], tmp_path) == 0  # an empty root: no device tree
    out = capsys.readouterr().out
    assert "not an RK3588" in out
    assert "ok   bundle:" in out and "built by rknn-toolkit2 2.5.0" in out
    assert "graphs: 9 of 9 loaded on the onnxruntime mock" in out
    assert "latency: decode floor" in out and "governor" not in out
    if native_build.compiler() is not None:
        assert "ok   decode kernels: compiled (" in out
    assert out.rstrip().endswith("ready (not an RK3588: the checks a host allows passed)")


def test_json_report(tmp_path, lite2_installed, capsys):
    assert doctor(["--quick", "--json"], fake_board(tmp_path, ddr="simple_ondemand")) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ready"] is False and report["machine"]["rk3588"] is True
    ddr = next(c for c in report["checks"] if c["name"] == "DDR clock")
    assert ddr["status"] == "fail"
    fix = ddr["fix"].splitlines()
    assert fix == ["echo performance | sudo tee /sys/class/devfreq/dmc/governor",
                   "or every clock at once: sudo board/governors.sh apply"]


def test_broken_bundle_and_crashing_checks_are_findings(tmp_path, monkeypatch, capsys):
    def boom(_root):
        raise PermissionError("sysfs said no")

    monkeypatch.setattr(board, "thermals", boom)
    code = doctor(["--bundle", str(tmp_path / "nope")], fake_board(tmp_path / "root"))
    out = capsys.readouterr().out
    assert code == 1 and "Traceback" not in out
    assert "FAIL bundle:" in out and "does not exist" in out
    assert "FAIL thermal: check crashed: PermissionError: sysfs said no" in out


def test_sysroot_reads_are_robust(tmp_path):
    sys_root = SysRoot(tmp_path)
    assert sys_root.read("sys/kernel/debug/rknpu/version") is None
    assert sys_root.read_int("proc/nothing") is None
    assert sys_root.glob("sys/class/thermal", "thermal_zone*") == []
    assert board.driver(sys_root).status == "warn"


def cli_demo_bundle() -> Path:
    from ling3_rknn.demo import bundle_dir

    return bundle_dir()


def test_doctor_arguments():
    args = cli.build_parser().parse_args(["doctor", "--bundle", "b", "--json", "--quick"])
    assert isinstance(args, argparse.Namespace)
    assert (args.command, str(args.bundle), args.json, args.quick) == ("doctor", "b", True, True)


SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"


def test_the_unit_runs_doctor_quick_before_serving():
    unit = (SYSTEMD / "ling3-rknn.service").read_text()
    pre = [line for line in unit.splitlines() if line.startswith("ExecStartPre=")]
    assert pre == ["ExecStartPre=-/opt/ling3-rknn/.venv/bin/ling3-rknn doctor --quick "
                   "--bundle ${LING3_RKNN_BUNDLE}"]
    args = cli.build_parser().parse_args(pre[0].split("ling3-rknn ", 1)[1].split())
    assert args.command == "doctor" and args.quick


def test_serve_knows_the_env_files_placeholder():
    env = (SYSTEMD / "ling3-rknn.env").read_text()
    assert f"{cli.API_KEY_ENV}={cli.PLACEHOLDER_API_KEY}\n" in env
    assert cli.SERVICE_ENV_FILE in env  # the file's own header names where it lives


def test_toolkit_version_in_an_rknn_header():
    from ling3_rknn.doctor.graphs import _COMPILER

    header = b"RKNN\0\0\x06" + b"\0" * 40 + b"2.5.0(compiler version: 2.5.0 (abc@2025))\0"
    match = _COMPILER.search(header)
    assert match is not None and match.group(1) == b"2.5.0"


def test_the_entry_point_never_tracebacks(tmp_path):
    """As the unit runs it: a subprocess, here on an empty root (not an RK3588)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LING3_RKNN_DOCTOR_ROOT": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "ling3_rknn.cli", "doctor", "--quick",
                           "--json", "--bundle", str(tmp_path / "missing")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    report = json.loads(done.stdout)
    assert report["ready"] is False and report["machine"]["rk3588"] is False
    assert {c["name"]: c["status"] for c in report["checks"]}["bundle"] == "fail"


def test_full_run_on_the_board_loads_and_times_every_graph(tmp_path, lite2_installed,
                                                          monkeypatch):
    """Without --quick: every graph through the RKNNLite class (the mock stands in)."""
    from ling3_rknn.doctor import command
    from ling3_rknn.npu import MockRKNNLite

    monkeypatch.setattr(command, "_rknnlite_class", lambda on_board: MockRKNNLite)
    report = diagnose(cli_demo_bundle(), False, SysRoot(fake_board(tmp_path)))
    found = by_name(report)
    assert report.ready and found["graphs"].detail == "9 of 9 loaded on the NPU"
    assert set(found["graphs"].data["stages"]["final"]["median_ms"]) == {"T=1", "T=64"}
    assert found["latency"].data["calls"] == 9


def test_a_graph_that_does_not_load_is_a_failure(tmp_path, lite2_installed, monkeypatch):
    from ling3_rknn.doctor import command

    class Broken:
        def __init__(self, verbose: bool = False) -> None:
            pass

        def load_rknn(self, path: str) -> int:
            return -1

        def release(self) -> None:
            pass

    monkeypatch.setattr(command, "_rknnlite_class", lambda on_board: Broken)
    report = diagnose(cli_demo_bundle(), False, SysRoot(fake_board(tmp_path)))
    assert not report.ready
    assert by_name(report)["graphs"].detail == "0 of 9 loaded on the NPU"
    assert "does not load on core" in by_name(report)["graph final"].detail


def test_memory_says_whether_the_int8_expert_copy_is_loaded(tmp_path):
    """The full model on a 16 GB board takes the copy, on an 8 GB one not."""
    gib = 2**30
    model, copy, seq = int(5.33 * gib), 23 * 128 * 2_369_536, int(0.44 * gib)

    def cm3588(name: str, total_gib: float, available_gib: float) -> SysRoot:
        root = fake_board(tmp_path / name)
        (root / "proc" / "meminfo").write_text(
            f"MemTotal: {int(total_gib * GIB_KB)} kB\n"
            f"MemAvailable: {int(available_gib * GIB_KB)} kB\n")
        return SysRoot(root)

    big = host.memory(cm3588("16", 15.6, 15.0), model, seq, npu_copy=copy)
    assert big.status == "ok", big.detail
    assert big.data["npu_experts_taken"] and big.data["npu_experts_bytes"] == copy
    assert f"int8 copy for the NPU ({copy / gib:.2f} GiB) is loaded" in big.detail
    # beside the copy the cache and the scratch get 0.88 GiB each, not 2
    assert big.data["cache_bytes"] == pytest.approx(0.88 * gib, abs=0.02 * gib)
    small = host.memory(cm3588("8", 7.7, 7.2), model, seq, npu_copy=copy)
    assert not small.data["npu_experts_taken"] and "is not loaded" in small.detail
    none = host.memory(cm3588("n", 15.6, 15.0), model, seq)
    assert none.data["npu_experts_bytes"] == 0 and "int8 copy" not in none.detail

"""board/governors.sh on a fake RK3588 sysfs: apply pins every clock domain to
performance and says what changed, a second apply changes nothing, undo restores exactly
what apply found, and a domain without a performance governor is reported, not forced."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "board" / "governors.sh"


def fake_board(root: Path) -> dict[str, Path]:
    files = {}
    for policy, gov in (("policy0", "schedutil"), ("policy4", "schedutil"),
                        ("policy6", "performance")):
        d = root / "sys/devices/system/cpu/cpufreq" / policy
        d.mkdir(parents=True)
        (d / "scaling_governor").write_text(gov + "\n")
        (d / "scaling_available_governors").write_text("ondemand schedutil performance\n")
        (d / "scaling_cur_freq").write_text("1800000\n")
        files[policy] = d / "scaling_governor"
    for dev, gov, avail in (("fdab0000.npu", "rknpu_ondemand", "rknpu_ondemand performance"),
                            ("dmc", "dmc_ondemand", "dmc_ondemand userspace performance")):
        d = root / "sys/class/devfreq" / dev
        d.mkdir(parents=True)
        (d / "governor").write_text(gov + "\n")
        (d / "available_governors").write_text(avail + "\n")
        (d / "cur_freq").write_text("528000000\n")
        files[dev] = d / "governor"
    return files


def run(root: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"SYSFS_ROOT": str(root), "LING3_RKNN_GOVERNOR_STATE": str(state),
           "PATH": "/usr/bin:/bin"}
    return subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True, env=env)


def read(files: dict[str, Path]) -> dict[str, str]:
    return {k: p.read_text().strip() for k, p in files.items()}


def test_apply_is_idempotent_and_undo_restores(tmp_path):
    files = fake_board(tmp_path / "sys_root")
    before = read(files)
    state = tmp_path / "state" / "governors.saved"
    first = run(tmp_path / "sys_root", state, "apply")
    assert first.returncode == 0, first.stderr
    assert set(read(files).values()) == {"performance"}
    assert "/sys/class/devfreq/dmc: dmc_ondemand -> performance" in first.stdout
    assert "cpufreq/policy6: performance (unchanged)" in first.stdout
    second = run(tmp_path / "sys_root", state, "apply")
    assert second.stdout.count("(unchanged)") == 5 and "->" not in second.stdout
    undo = run(tmp_path / "sys_root", state, "undo")
    assert undo.returncode == 0, undo.stderr
    assert read(files) == before
    assert not state.exists()
    again = run(tmp_path / "sys_root", state, "undo")
    assert again.returncode == 1 and "nothing to undo" in again.stderr


def test_a_domain_without_performance_is_reported_not_forced(tmp_path):
    files = fake_board(tmp_path / "r")
    (tmp_path / "r/sys/class/devfreq/fdab0000.npu/available_governors").write_text(
        "rknpu_ondemand\n")
    out = run(tmp_path / "r", tmp_path / "s", "apply")
    assert out.returncode == 0
    assert read(files)["fdab0000.npu"] == "rknpu_ondemand"
    assert "no performance governor offered" in out.stderr


def test_status_and_usage(tmp_path):
    fake_board(tmp_path / "r")
    out = run(tmp_path / "r", tmp_path / "s", "status")
    assert "/sys/class/devfreq/dmc: dmc_ondemand at 528000000" in out.stdout
    assert run(tmp_path / "r", tmp_path / "s", "bogus").returncode == 2

"""Checks of the RK3588 itself: SoC, NPU driver, librknnrt, governors, clocks, thermals.

Why these: a board at half its expected tok/s is almost always a governor (CPU, NPU or
DDR) left on ``ondemand``/``simple_ondemand``, a too-old rknpu driver or a librknnrt
older than the toolkit that built the ``.rknn`` files ("Invalid RKNN model version",
docs/toolchain.md 1), or a board throttling above about 80 °C.
"""

from __future__ import annotations

import re
from pathlib import Path

from ling3_rknn.cpu_threads import is_rk3588
from ling3_rknn.doctor.report import Check
from ling3_rknn.doctor.sysfs import SysRoot

DT_COMPATIBLE = "proc/device-tree/compatible"
DRIVER_VERSION_FILES = ("sys/kernel/debug/rknpu/version", "sys/module/rknpu/version",
                        "proc/rknpu/version")
# Rockchip publishes no driver/runtime matrix; boards still ship rknpu 0.8.x, runtime 2.x
# is reported not to work with 0.9.2 (github.com/airockchip/rknn-toolkit2 issue 465) and
# RKLLM warns below 0.9.7 (github.com/Pelochus/ezrknn-llm issue 19). Older than this is a
# warning: the graphs-load check (without --quick) is the proof either way.
MIN_DRIVER = (0, 9, 6)
LIBRKNNRT = "usr/lib/librknnrt.so"
LIBRKNNRT_URL = ("https://github.com/airockchip/rknn-toolkit2/tree/master/rknpu2/runtime/"
                 "Linux/librknn_api/aarch64")
NPU_DEVFREQ = "sys/class/devfreq/fdab0000.npu"
DMC_DEVFREQ = "sys/class/devfreq/dmc"
CPUFREQ = "sys/devices/system/cpu/cpufreq"
THERMAL = "sys/class/thermal"
# every clock at once, and undone with `undo` (board/governors.sh in the checkout)
GOVERNORS_SCRIPT = "or every clock at once: sudo board/governors.sh apply"
HOT_C = 80.0  # the RK3588 throttles above about 80 °C
_VERSION = re.compile(rb"librknnrt version: ([0-9][0-9A-Za-z.+-]*)")


def soc(sys: SysRoot) -> tuple[bool, Check]:
    """Whether this is an RK3588 (device tree), and the finding that says so."""
    raw = sys.read(DT_COMPATIBLE)
    names = [n for n in (raw or "").split("\x00") if n]
    if is_rk3588(sys.path(DT_COMPATIBLE)):  # the same test as the CPU thread policy
        return True, Check("SoC", "ok", ", ".join(names), data={"compatible": names})
    what = ", ".join(names) if names else f"no {SysRoot.shown(DT_COMPATIBLE)}"
    return False, Check("SoC", "skip", f"not an RK3588 ({what}); board checks skipped, "
                        "graphs run on the onnxruntime mock", data={"compatible": names})


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def driver(sys: SysRoot) -> Check:
    for rel in DRIVER_VERSION_FILES:
        text = sys.read(rel)
        if text:
            break
    else:
        return Check("NPU driver", "warn", "version not readable (debugfs needs root; "
                     "no /sys/module/rknpu/version)",
                     fix="sudo cat /sys/kernel/debug/rknpu/version")
    version = _version_tuple(text)
    data = {"version": text, "source": SysRoot.shown(rel)}
    if version and version < MIN_DRIVER:
        need = ".".join(map(str, MIN_DRIVER))
        return Check("NPU driver", "warn", f"{text} is older than rknpu {need}, which "
                     "current librknnrt releases may refuse",
                     fix=f"install the board vendor's current kernel (rknpu >= {need}), "
                         "then reboot", data=data)
    return Check("NPU driver", "ok", text, data=data)


def librknnrt_version(path: Path) -> str | None:
    """The version string librknnrt embeds ("librknnrt version: 2.3.2 (...)")."""
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            match = _VERSION.search(tail + chunk)
            if match:
                return match.group(1).decode()
            tail = chunk[-64:]
    return None


def librknnrt(sys: SysRoot, toolkit: str | None) -> Check:
    """Present, and at least as new as the toolkit named in the bundle's manifest."""
    path = sys.path(LIBRKNNRT)
    fix = (f"download librknnrt.so {toolkit or ''} from {LIBRKNNRT_URL} (newer releases: "
           "Rockchip's RKNPU2 SDK) and `sudo install -m 0644 librknnrt.so /usr/lib/ && "
           "sudo ldconfig`").replace("  ", " ")
    if not path.is_file():
        return Check("librknnrt", "fail", f"{SysRoot.shown(LIBRKNNRT)} missing", fix=fix)
    version = librknnrt_version(path)
    data = {"version": version, "toolkit": toolkit}
    if version is None:
        return Check("librknnrt", "warn", "present, no version string found", data=data)
    if toolkit and _version_tuple(version) < _version_tuple(toolkit):
        return Check("librknnrt", "fail", f"{version} is older than the toolkit that built "
                     f"the bundle ({toolkit}): the graphs fail with 'Invalid RKNN model "
                     "version'", fix=fix, data=data)
    return Check("librknnrt", "ok", version, data=data)


def _mhz(value: int | None, unit_hz: int) -> str:
    return "?" if value is None else f"{value * unit_hz / 1e6:.0f} MHz"


def _governor_check(name: str, rel: str, governor: str | None, clocks: str,
                    data: dict[str, object]) -> Check:
    fix = f"echo performance | sudo tee {SysRoot.shown(rel)}\n{GOVERNORS_SCRIPT}"
    data = {"governor": governor, **data}
    if governor is None:
        return Check(name, "warn", f"{SysRoot.shown(rel)} missing", data=data)
    if governor != "performance":
        return Check(name, "fail", f"governor {governor} (want performance); {clocks}",
                     fix=fix, data=data)
    return Check(name, "ok", f"governor performance; {clocks}", data=data)


def cpu_governors(sys: SysRoot) -> list[Check]:
    """One finding per cpufreq policy (RK3588: policy0 A55, policy4/policy6 A76)."""
    checks = []
    for policy in sys.glob(CPUFREQ, "policy*"):
        cur = sys.read_int(f"{policy}/scaling_cur_freq")
        top = sys.read_int(f"{policy}/cpuinfo_max_freq")
        cpus = sys.read(f"{policy}/related_cpus") or "?"
        checks.append(_governor_check(
            f"CPU {policy.rsplit('/', 1)[1]} (cpus {cpus})", f"{policy}/scaling_governor",
            sys.read(f"{policy}/scaling_governor"),
            f"{_mhz(cur, 1000)} of {_mhz(top, 1000)}", {"cur_khz": cur, "max_khz": top}))
    if not checks:
        checks.append(Check("CPU governors", "warn", f"no {SysRoot.shown(CPUFREQ)}/policy*"))
    return checks


def devfreq(sys: SysRoot, name: str, rel: str, missing_fix: str) -> Check:
    """The NPU (fdab0000.npu) or DDR (dmc) devfreq governor and clock."""
    if not sys.path(rel).is_dir():
        return Check(name, "warn", f"no {SysRoot.shown(rel)}: its clock cannot be pinned",
                     fix=missing_fix)
    cur, top = sys.read_int(f"{rel}/cur_freq"), sys.read_int(f"{rel}/max_freq")
    return _governor_check(name, f"{rel}/governor", sys.read(f"{rel}/governor"),
                           f"{_mhz(cur, 1)} of {_mhz(top, 1)}",
                           {"cur_hz": cur, "max_hz": top})


def npu_ddr(sys: SysRoot) -> list[Check]:
    return [
        devfreq(sys, "NPU clock", NPU_DEVFREQ, "a kernel with the rknpu devfreq node "
                "(the board vendor's image)"),
        devfreq(sys, "DDR clock", DMC_DEVFREQ, "enable the dmc devfreq in the device tree "
                "(the board vendor's image has it); without it DDR runs at the boot clock"),
    ]


def thermals(sys: SysRoot) -> Check:
    """Every thermal zone in one line; a warning at the throttling point."""
    temps: dict[str, float] = {}
    for zone in sys.glob(THERMAL, "thermal_zone*"):
        milli = sys.read_int(f"{zone}/temp")
        if milli is not None:
            kind = sys.read(f"{zone}/type") or zone.rsplit("/", 1)[1]
            temps[kind.removesuffix("-thermal")] = milli / 1000
    if not temps:
        return Check("thermal", "skip", f"no {SysRoot.shown(THERMAL)}/thermal_zone*/temp")
    detail = ", ".join(f"{k} {v:.1f} °C" for k, v in temps.items())
    hot = max(temps.values())
    if hot >= HOT_C:
        return Check("thermal", "warn", f"{detail}: throttles above about {HOT_C:.0f} °C",
                     fix="fit a heatsink and fan and check the airflow", data={"celsius": temps})
    return Check("thermal", "ok", detail, data={"celsius": temps})

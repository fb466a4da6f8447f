"""A fake RK3588 filesystem tree for ``ling3-rknn doctor`` (its ``SysRoot``): what the doctor
reads on a CM3588, the device tree, the rknpu version, cpufreq policies, the NPU and DDR
devfreq nodes, thermal zones, meminfo and librknnrt."""

from __future__ import annotations

from pathlib import Path

GIB_KB = 1024 * 1024


def fake_board(root: Path, *, cpu_governor: str = "performance", npu: str = "performance",
               ddr: str | None = "performance", driver: str = "RKNPU driver: v0.9.8",
               temp_milli: int = 45000, mem_kb: int = 16 * GIB_KB,
               librknnrt: bytes | None = b"\0librknnrt version: 2.5.0 (abc@2025)\0") -> Path:
    def put(rel: str, text: str | bytes) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)

    put("proc/device-tree/compatible", "friendlyelec,cm3588\0rockchip,rk3588\0")
    put("proc/device-tree/model", "FriendlyElec CM3588\0")
    put("sys/module/rknpu/version", driver + "\n")
    for policy, cpus, top in (("policy0", "0 1 2 3", 1800000), ("policy4", "4 5", 2352000),
                              ("policy6", "6 7", 2352000)):
        base = f"sys/devices/system/cpu/cpufreq/{policy}"
        put(f"{base}/scaling_governor", cpu_governor + "\n")
        put(f"{base}/related_cpus", cpus + "\n")
        put(f"{base}/scaling_cur_freq", f"{top}\n")
        put(f"{base}/cpuinfo_max_freq", f"{top}\n")
    put("sys/class/devfreq/fdab0000.npu/governor", npu + "\n")
    put("sys/class/devfreq/fdab0000.npu/cur_freq", "1000000000\n")
    put("sys/class/devfreq/fdab0000.npu/max_freq", "1000000000\n")
    if ddr is not None:
        put("sys/class/devfreq/dmc/governor", ddr + "\n")
        put("sys/class/devfreq/dmc/cur_freq", "2112000000\n")
        put("sys/class/devfreq/dmc/max_freq", "2112000000\n")
    for i, kind in enumerate(("soc-thermal", "npu-thermal")):
        put(f"sys/class/thermal/thermal_zone{i}/type", kind + "\n")
        put(f"sys/class/thermal/thermal_zone{i}/temp", f"{temp_milli}\n")
    put("proc/meminfo", f"MemTotal: {mem_kb} kB\nMemFree: {mem_kb // 2} kB\n"
                        f"MemAvailable: {mem_kb // 2} kB\n")
    if librknnrt is not None:
        put("usr/lib/librknnrt.so", b"\x7fELF" + b"x" * 5000 + librknnrt)
    return root

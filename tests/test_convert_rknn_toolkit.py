"""The rknn-toolkit2 subprocess wrapper's error handling, without the toolkit.

A fake interpreter (``LING3_RKNN_PYTHON``) plays the build script so every failure path of
:func:`convert.rknn_toolkit.build_rknn` is exercised in the normal test run; the real
toolkit is exercised by the simulator tier.
"""

from __future__ import annotations

import json
import stat

import numpy as np
import pytest

from convert.rknn_toolkit import (
    RknnBuildError,
    RknnToolkitMissing,
    build_rknn,
    cpu_fallback_ops,
    rknn_available,
    rknn_python,
)


def fake_python(tmp_path, body: str):
    script = tmp_path / "fake-python"
    script.write_text("#!/usr/bin/env python3\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


ARGS = """
import json, sys
args = sys.argv[2:]
opt = {a: b for a, b in zip(args, args[1:] + [""]) if a.startswith("--")}
"""


def test_missing_toolkit_is_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LING3_RKNN_PYTHON", str(tmp_path / "nope" / "python"))
    assert not rknn_available()
    with pytest.raises(RknnToolkitMissing, match="make rknn-env"):
        rknn_python()
    with pytest.raises(RknnToolkitMissing):
        build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "fp16")


def test_argument_checks_come_first(tmp_path):
    with pytest.raises(ValueError, match="quant"):
        build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "w4a16")
    with pytest.raises(ValueError, match="calibration"):
        build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "w8a8")


def test_a_crash_without_result_is_reported_with_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("LING3_RKNN_PYTHON", str(fake_python(
        tmp_path, "import sys\nprint('Segmentation fault in librknnc')\nsys.exit(139)\n")))
    with pytest.raises(RknnBuildError) as info:
        build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "fp16")
    assert info.value.step == "process" and "librknnc" in info.value.log


def test_a_failed_step_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("LING3_RKNN_PYTHON", str(fake_python(tmp_path, ARGS + """
open(opt["--result"], "w").write(json.dumps({"ok": False, "step": "build",
                                             "error": "REGTASK Overflow"}))
sys.exit(2)
""")))
    with pytest.raises(RknnBuildError, match="at build: REGTASK Overflow"):
        build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "fp16")


def test_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("LING3_RKNN_PYTHON", str(fake_python(
        tmp_path, "import time\ntime.sleep(30)\n")))
    with pytest.raises(RknnBuildError, match="no result after"):
        build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "fp16", timeout=0.5)


def test_inputs_and_outputs_round_trip_through_npz(tmp_path, monkeypatch):
    """The wrapper's file protocol: calibration and simulate groups go out as npz with a
    sample axis, outputs come back per group under the graph's output names."""
    monkeypatch.setenv("LING3_RKNN_PYTHON", str(fake_python(tmp_path, ARGS + """
import numpy as np
sims = [args[i + 1] for i in range(len(args)) if args[i] == "--simulate"]
outs = [args[i + 1] for i in range(len(args)) if args[i] == "--sim-out"]
calib = np.load(opt["--calibration"])
assert calib["x"].shape == (4, 1, 2, 8), calib["x"].shape
assert json.loads(opt["--dynamic-input"]) == [[[1, 1, 8]], [[1, 2, 8]]]
for s, o in zip(sims, outs):
    x = np.load(s)["x"]
    np.savez(o, y=x * 2)
open(opt["--out"], "wb").write(b"rknn!")
open(opt["--result"], "w").write(json.dumps({"ok": True, "bytes": 5, "build_s": 0.1,
                                             "sim_s": 0.2, "outputs": ["y"]}))
""")))
    rng = np.random.default_rng(0)
    groups = [{"x": rng.normal(size=(3, 1, t, 8))} for t in (1, 2)]
    res = build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "w8a8",
                     calibration={"x": rng.normal(size=(4, 1, 2, 8))}, simulate_inputs=groups,
                     dynamic_input=[[[1, 1, 8]], [[1, 2, 8]]])
    assert res.size_bytes == 5 and res.outputs is None and len(res.groups) == 2
    for g, out in zip(groups, res.groups, strict=True):
        np.testing.assert_allclose(out["y"], g["x"].astype(np.float32) * 2)
    single = build_rknn(tmp_path / "g.onnx", tmp_path / "g.rknn", "w8a8",
                        calibration={"x": rng.normal(size=(4, 1, 2, 8))},
                        simulate_inputs=groups[1], dynamic_input=[[[1, 1, 8]], [[1, 2, 8]]])
    assert single.outputs["y"].shape == (3, 1, 2, 8)
    assert json.loads(json.dumps(single.sim_seconds)) == 0.2


def test_cpu_fallback_ops_are_parsed_from_the_layer_table():
    log = "\n".join([
        "D RKNN: [20:29:08.435] ID   OpType   DataType Target InputShape  OutputShape  "
        "Cycles(DDR/NPU/Total)    RW(KB)       FullName",
        "D RKNN: [20:29:08.435] 0    InputOperator  FLOAT16  CPU  \\  (1,1,64)  0/0/0  0  "
        "InputOperator:x",
        "D RKNN: [20:29:08.435] 2    Exp  FLOAT16  CPU  (1,64,1,1)  (1,64,1,1)  0/0/0  0  "
        "Exp:exp_1",
        "D RKNN: [20:29:08.435] 3    exNorm  FLOAT16  NPU  (1,64,1,1),(1,64,1,1)  (1,64,1,1) "
        " 0/0/0  0  exNorm:reducemean_3",
        "D RKNN: [20:29:08.440] 2    Exp  FLOAT16  CPU  (1,64,4,1)  (1,64,4,1)  0/0/0  0  "
        "Exp:exp_1",
        "D RKNN: [20:29:08.435] 6    OutputOperator  FLOAT16  CPU  (1,1,32)  \\  0/0/0  0  "
        "OutputOperator:y",
    ])
    assert cpu_fallback_ops(log) == ("Exp:exp_1",)
    assert cpu_fallback_ops("no table here") == ()


def test_relative_paths_reach_the_toolkit_process_absolute(tmp_path, monkeypatch):
    """`ling3-rknn convert ckpt out/` passes paths relative to the caller's directory; the
    toolkit process runs in its own work directory, so they must arrive absolute."""
    import subprocess

    from convert import rknn_toolkit

    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"], seen["cwd"] = cmd, kwargs.get("cwd")
        raise subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rknn_toolkit, "rknn_python", lambda: "python3")
    monkeypatch.setattr(rknn_toolkit.subprocess, "run", fake_run)
    with pytest.raises(rknn_toolkit.RknnBuildError):
        rknn_toolkit.build_rknn("stages/a.onnx", "stages/a.rknn", quant="fp16")
    cmd = seen["cmd"]
    for flag in ("--onnx", "--out"):
        value = cmd[cmd.index(flag) + 1]
        assert value == str(tmp_path / "stages" / value.rsplit("/", 1)[-1])

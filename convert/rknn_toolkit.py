"""Python API over rknn-toolkit2, which lives in its own venv (it needs numpy<2).

:func:`build_rknn` runs ``convert/rknn_build.py`` with ``.venv-rknn``'s interpreter
(override with ``LING3_RKNN_PYTHON``) and returns the simulator outputs, so the converter
and the simulator tests can stay in the project's numpy-2 environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convert.options import DEFAULT_W8A8_ALGORITHM

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = Path(__file__).resolve().with_name("rknn_build.py")
QUANT_TYPES = ("fp16", "w8a8")
# One row of the compiler's layer table (printed with verbose=True):
# "D RKNN: [hh:mm:ss.ms] ID OpType DataType Target InputShape ... FullName"
_PLACEMENT_ROW = re.compile(
    r"D RKNN: \[[\d:.]+\]\s+\d+\s+(?P<op>\S+)\s+\S+\s+(?P<target>CPU|NPU)\s.*?(?P<name>\S+)\s*$")
_IO_OPERATORS = ("InputOperator", "OutputOperator")


class RknnToolkitError(RuntimeError):
    """rknn-toolkit2 is unavailable or failed."""


class RknnToolkitMissing(RknnToolkitError):
    """No interpreter with rknn-toolkit2 (run ``make rknn-env``)."""


class RknnBuildError(RknnToolkitError):
    def __init__(self, step: str, message: str, log: str = "") -> None:
        super().__init__(f"rknn build failed at {step}: {message}")
        self.step = step
        self.log = log


@dataclass(frozen=True)
class RknnBuildResult:
    rknn_path: Path
    size_bytes: int
    build_seconds: float
    sim_seconds: float | None
    groups: list[dict[str, np.ndarray]]  # per simulate group: output name -> [N, *shape]
    log: str
    cpu_ops: tuple[str, ...] = ()  # "OpType:node" the compiler left on the CPU (sync points)

    @property
    def outputs(self) -> dict[str, np.ndarray] | None:
        """The simulator outputs when exactly one input group was simulated."""
        return self.groups[0] if len(self.groups) == 1 else None


def cpu_fallback_ops(log: str) -> tuple[str, ...]:
    """Ops the compiler placed on the board's CPU, from its verbose layer table."""
    found = []
    for line in log.splitlines():
        m = _PLACEMENT_ROW.search(line)
        if (m and m["target"] == "CPU" and m["op"] not in _IO_OPERATORS
                and m["name"] not in found):
            found.append(m["name"])
    return tuple(found)


def rknn_python() -> Path:
    """Interpreter of the rknn-toolkit2 environment; raises if there is none."""
    override = os.environ.get("LING3_RKNN_PYTHON")
    path = Path(override) if override else REPO_ROOT / ".venv-rknn" / "bin" / "python"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RknnToolkitMissing(
            f"no rknn-toolkit2 interpreter at {path}; run `make rknn-env` "
            "or set LING3_RKNN_PYTHON"
        )
    return path


def rknn_available() -> bool:
    try:
        rknn_python()
    except RknnToolkitMissing:
        return False
    return True


def _save_samples(path: Path, samples: Mapping[str, np.ndarray]) -> None:
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in samples.items()}
    # numpy's stub also matches **arrays against savez's allow_pickle: bool
    np.savez(path, **arrays)  # type: ignore[arg-type]


def build_rknn(
    onnx_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    quant: str,
    calibration: Mapping[str, np.ndarray] | str | os.PathLike[str] | None = None,
    simulate_inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]] | None = None,
    *,
    target: str = "rk3588",
    dynamic_input: Sequence[Sequence[Sequence[int]]] | None = None,
    algorithm: str = DEFAULT_W8A8_ALGORITHM,
    hybrid_cos: float | None = None,
    timeout: float | None = None,
) -> RknnBuildResult:
    """Convert ``onnx_path`` to ``out_path`` (fp16 or w8a8) and optionally simulate.

    ``calibration`` (required for w8a8): input name -> ``[N, *shape]`` real activations,
    or a path to such an ``.npz``. ``simulate_inputs``: same layout, or a list of such
    groups (one per shape set of a multi-shape graph); the outputs come back per group
    (``result.groups``) keyed by graph output name with the same leading sample axis.
    """
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant must be one of {QUANT_TYPES}, got {quant!r}")
    if quant == "w8a8" and calibration is None:
        raise ValueError("w8a8 quantization needs a calibration set of real inputs")
    python = rknn_python()
    # Absolute: the toolkit process runs in its own work directory, so a path relative to
    # ours (`ling3-rknn convert ckpt out/`) would point nowhere there.
    onnx_path, out_path = Path(onnx_path).resolve(), Path(out_path).resolve()
    with tempfile.TemporaryDirectory(prefix="ling3-rknn-") as tmp:
        work = Path(tmp)
        cmd = [str(python), str(BUILD_SCRIPT), "--onnx", str(onnx_path), "--out", str(out_path),
               "--quant", quant, "--target", target, "--algorithm", algorithm,
               "--result", str(work / "result.json"), "--verbose"]
        if hybrid_cos is not None:
            cmd += ["--hybrid-cos", repr(float(hybrid_cos))]
        if calibration is not None:
            if isinstance(calibration, Mapping):
                _save_samples(work / "calib.npz", calibration)
                calibration = work / "calib.npz"
            cmd += ["--calibration", str(Path(calibration).resolve())]
        groups = ([] if simulate_inputs is None else [simulate_inputs]
                  if isinstance(simulate_inputs, Mapping) else list(simulate_inputs))
        for g, feeds in enumerate(groups):
            _save_samples(work / f"sim_in{g}.npz", feeds)
            cmd += ["--simulate", str(work / f"sim_in{g}.npz"),
                    "--sim-out", str(work / f"sim_out{g}.npz")]
        if dynamic_input is not None:
            cmd += ["--dynamic-input", json.dumps([[list(s) for s in group]
                                                   for group in dynamic_input])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=work, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RknnBuildError("timeout", f"no result after {timeout} s") from exc
        log = proc.stdout + proc.stderr
        result_file = work / "result.json"
        if not result_file.is_file():
            raise RknnBuildError("process", f"exit status {proc.returncode}", log[-4000:])
        result = json.loads(result_file.read_text())
        if not result.get("ok") or proc.returncode != 0:
            raise RknnBuildError(result.get("step", "unknown"), result.get("error", "?"),
                                 log[-4000:])
        outputs = []
        for g in range(len(groups)):
            with np.load(work / f"sim_out{g}.npz") as data:
                outputs.append({name: data[name] for name in result["outputs"]})
    return RknnBuildResult(out_path, int(result["bytes"]), float(result["build_s"]),
                           result.get("sim_s"), outputs, log, cpu_fallback_ops(log))

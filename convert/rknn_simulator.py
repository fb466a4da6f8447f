"""Stage graphs run by rknn-toolkit2's simulator, as runtime graph executors.

Evaluation machinery (the simulator test tier, ``convert.demo_model.evaluate --simulate``),
never used by a conversion or shipped to the board.

The bundle's w8a8 ONNX twin imitates the NPU's int8 error with onnxruntime's QDQ
quantizer; the simulator *is* the toolkit's quantization. :class:`SimulatedGraphs` builds
a set of stage graphs once in a long-lived ``.venv-rknn`` process
(``rknn_sim_server.py``) and hands out executors with the runtime's ``GraphExecutor``
API, so a whole model (``Model.from_bundle`` with its stages swapped in by
``GraphStages.replace_executors``) runs its dense work through the real quantizer: the
quantized end-to-end figure of issue 4.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from convert.options import DEFAULT_W8A8_ALGORITHM
from convert.rknn_toolkit import RknnToolkitError, rknn_python
from ling3_rknn.bundle import StageSpec

SERVER_SCRIPT = Path(__file__).resolve().with_name("rknn_sim_server.py")


@dataclass(frozen=True)
class SimulatedStage:
    """One graph to build: its fp32 ONNX, precision, calibration (w8a8) and shape sets."""

    spec: StageSpec
    onnx_path: Path
    quant: str
    calibration: Mapping[str, np.ndarray] | None = None
    hybrid_cos: float | None = None
    algorithm: str = DEFAULT_W8A8_ALGORITHM


class SimulatedGraphs:
    """Context manager: the simulator process and one executor per built stage."""

    def __init__(self, stages: Sequence[SimulatedStage], timeout: float = 1800) -> None:
        self._stages = {s.spec.name: s for s in stages}
        self._timeout = timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="ling3-rknn-sim-")
        self._work = Path(self._tmp.name)
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self.build_seconds = 0.0
        self.calls = 0

    def __enter__(self) -> SimulatedGraphs:
        jobs = []
        for name, s in self._stages.items():
            job = {"name": name, "onnx": str(s.onnx_path), "quant": s.quant,
                   "algorithm": s.algorithm, "hybrid_cos": s.hybrid_cos,
                   "dynamic_input": [[list(shape) for shape in group]
                                     for group in s.spec.shape_sets]}
            if s.calibration is not None:
                path = self._work / f"{name}.calib.npz"
                arrays = {k: np.asarray(v, np.float32) for k, v in s.calibration.items()}
                # numpy's stub also matches **arrays against savez's allow_pickle: bool
                np.savez(path, **arrays)  # type: ignore[arg-type]
                job["calibration"] = str(path)
            jobs.append(job)
        (self._work / "jobs.json").write_text(json.dumps(jobs))
        self._log = open(self._work / "server.log", "w")  # closed in close()
        self._proc = subprocess.Popen(
            [str(rknn_python()), str(SERVER_SCRIPT), "--jobs", str(self._work / "jobs.json")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            cwd=self._work)
        ready = self._read()
        if not ready.get("ready"):
            self.close()
            raise RknnToolkitError(f"simulator build failed: {ready.get('error')}")
        self.build_seconds = float(ready["build_s"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> dict:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            log = (self._work / "server.log").read_text(errors="replace")[-4000:]
            raise RknnToolkitError(f"simulator process ended (status {self._proc.poll()}): "
                                   f"{log}")
        return json.loads(line)

    def run(self, name: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        spec = self._stages[name].spec
        if self._proc is None or self._proc.stdin is None:
            raise RknnToolkitError("the simulator session is closed")
        feeds, outs = self._work / "in.npz", self._work / "out.npz"
        arrays = {n: np.asarray(x, np.float32) for n, x in zip(spec.inputs, inputs, strict=True)}
        # numpy's stub also matches **arrays against savez's allow_pickle: bool
        np.savez(feeds, **arrays)  # type: ignore[arg-type]
        self._proc.stdin.write(json.dumps({"stage": name, "inputs": str(feeds),
                                           "outputs": str(outs)}) + "\n")
        self._proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RknnToolkitError(f"simulator inference of {name}: {reply.get('error')}")
        self.calls += 1
        with np.load(outs) as data:
            return [np.asarray(data[n]) for n in spec.outputs]

    def executors(self) -> dict[str, _SimulatedExecutor]:
        return {name: _SimulatedExecutor(self, s.spec) for name, s in self._stages.items()}

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._tmp.cleanup()


class _SimulatedExecutor:
    """``GraphExecutor`` over one stage of a :class:`SimulatedGraphs` session."""

    def __init__(self, session: SimulatedGraphs, spec: StageSpec) -> None:
        self._session, self.spec = session, spec

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        return self._session.run(self.spec.name, inputs)

    def close(self) -> None:  # the session owns the process
        pass

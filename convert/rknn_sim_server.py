"""Keep several stage graphs built in rknn-toolkit2's simulator and run them on request.

Evaluation machinery, not part of a conversion: only the simulator test tier and
``convert.demo_model.evaluate --simulate`` start it (through ``convert/rknn_simulator.py``).

Runs *inside* ``.venv-rknn`` (numpy<2), started by :class:`convert.rknn_simulator.
SimulatedGraphs`. A whole model's forward pass calls every stage once per chunk, so
building each graph per call (``rknn_build.py``) would repeat minutes of work; this
process builds them all once and then answers on stdin/stdout, one JSON line each way:

    -> {"stage": NAME, "inputs": IN.npz, "outputs": OUT.npz}    (one sample, [1, T, W])
    <- {"ok": true} | {"ok": false, "error": "..."}

It prints ``{"ready": true, "build_s": ...}`` once every job in ``--jobs`` is built
(or ``{"ready": false, "error": ...}`` and exits 2). End of stdin ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from rknn_build import BuildFailure, _check, _graph_io, configure_and_build

_protocol = sys.stdout  # replaced in main() by a private copy of the original stdout


def _reply(obj: dict) -> None:
    _protocol.write(json.dumps(obj) + "\n")
    _protocol.flush()


def _build_all(jobs: list[dict], workdir: Path) -> dict[str, tuple[Any, list[str], list[str]]]:
    from rknn.api import RKNN

    graphs = {}
    for job in jobs:
        onnx_path = Path(job["onnx"])
        in_names, out_names = _graph_io(onnx_path)
        rk = RKNN(verbose=False)
        graphs[job["name"]] = (rk, in_names, out_names)
        scratch = workdir / job["name"]
        scratch.mkdir()
        configure_and_build(rk, onnx_path, in_names, quant=job["quant"],
                            target=job.get("target", "rk3588"),
                            algorithm=job.get("algorithm", "normal"),
                            hybrid_cos=job.get("hybrid_cos"),
                            dynamic_input=json.dumps(job["dynamic_input"])
                            if job.get("dynamic_input") else None,
                            calibration=job.get("calibration"), workdir=scratch)
        _check(rk.init_runtime(), "init_runtime")
    return graphs


def _serve(graphs: dict[str, tuple[Any, list[str], list[str]]]) -> None:
    for line in sys.stdin:
        try:
            req = json.loads(line)
            rk, in_names, out_names = graphs[req["stage"]]
            with np.load(req["inputs"]) as data:
                feeds = [np.asarray(data[n], dtype=np.float32) for n in in_names]
            got = rk.inference(inputs=feeds)
            if got is None or len(got) != len(out_names):
                raise BuildFailure("inference", f"simulator returned {got!r:.200}")
            out = Path(req["outputs"])
            partial = out.with_name(f".{out.stem}.partial.npz")
            arrays = {n: np.asarray(a, np.float32) for n, a in zip(out_names, got, strict=True)}
            # numpy's stub also matches **arrays against savez's allow_pickle: bool
            np.savez(partial, **arrays)  # type: ignore[arg-type]
            os.replace(partial, out)
            _reply({"ok": True})
        except Exception as exc:  # one bad request must not end the session
            _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", required=True, help="JSON list of graphs to build")
    args = p.parse_args()
    jobs = json.loads(Path(args.jobs).read_text())
    # The toolkit prints progress on stdout (Python and C level): the protocol gets a
    # private copy of the original stdout, everything else goes to stderr.
    global _protocol
    _protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    graphs: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rknn-sim-") as tmp:
            t0 = time.perf_counter()
            try:
                graphs = _build_all(jobs, Path(tmp))
            except Exception as exc:
                _reply({"ready": False, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-4000:]})
                return 2
            _reply({"ready": True, "build_s": time.perf_counter() - t0})
            _serve(graphs)
    finally:
        for rk, _, _ in graphs.values():
            rk.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())

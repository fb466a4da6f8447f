"""Build one ONNX graph into a ``.rknn`` with rknn-toolkit2 and optionally simulate it.

Runs *inside* ``.venv-rknn`` (numpy<2, rknn-toolkit2 2.5.0), started as a subprocess by
:func:`convert.rknn_toolkit.build_rknn`; keep it free of project imports. Usage::

    .venv-rknn/bin/python convert/rknn_build.py --onnx g.onnx --out g.rknn --quant w8a8 \
        --calibration calib.npz [--simulate inputs.npz --sim-out outputs.npz] --result r.json

``calib.npz`` / ``inputs.npz`` map each graph input name to an array with a leading
sample axis ``[N, *input_shape]``; ``outputs.npz`` maps each graph output name to
``[N, *output_shape]``. ``--simulate``/``--sim-out`` repeat, one pair per input shape set
(a graph built with ``--dynamic-input`` is simulated at each of its shapes).

The ``.rknn`` is written to a temporary name and renamed into place only after a
successful export. The result JSON (also printed as a ``RESULT`` line) says what
happened; the exit status is 0 only on success.
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

QUANT_TYPES = ("fp16", "w8a8")


class BuildFailure(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step


def _check(ret: object, step: str) -> None:
    # rknn-toolkit2 raises on most errors but still returns -1 on some.
    if ret not in (0, None):
        raise BuildFailure(step, f"rknn-toolkit2 returned {ret!r}")


def _graph_io(onnx_path: Path) -> tuple[list[str], list[str]]:
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    return inputs, [o.name for o in model.graph.output]


def _load_samples(path: Path, names: list[str], what: str) -> list[np.ndarray]:
    with np.load(path) as data:
        missing = [n for n in names if n not in data.files]
        if missing:
            raise BuildFailure(what, f"{path.name} lacks inputs {missing} (has {data.files})")
        arrays = [np.asarray(data[n], dtype=np.float32) for n in names]
    counts = {a.shape[0] for a in arrays}
    if len(counts) != 1 or 0 in counts:
        raise BuildFailure(what, f"inputs must share a non-zero sample count, got {counts}")
    return arrays


def _write_dataset(arrays: list[np.ndarray], workdir: Path) -> Path:
    """rknn's dataset format: one line per sample, space-separated .npy per input."""
    lines = []
    for s in range(arrays[0].shape[0]):
        files = []
        for i, arr in enumerate(arrays):
            f = workdir / f"calib_{s}_{i}.npy"
            np.save(f, arr[s])
            files.append(str(f))
        lines.append(" ".join(files))
    dataset = workdir / "dataset.txt"
    dataset.write_text("\n".join(lines) + "\n")
    return dataset


def _simulate(rk: Any, sim_in: Path, sim_out: Path, in_names: list[str],
              out_names: list[str]) -> None:
    """Run every sample of ``sim_in`` through the simulator; write ``sim_out`` atomically."""
    feeds = _load_samples(sim_in, in_names, "simulate")
    outs: list[list[np.ndarray]] = [[] for _ in out_names]
    for s in range(feeds[0].shape[0]):
        sample = [f[s] for f in feeds]
        # 4-D inputs are taken as NHWC unless told otherwise; our graphs are laid out
        # like their ONNX declaration.
        fmt = ["nchw"] * len(sample) if any(a.ndim == 4 for a in sample) else None
        got = rk.inference(inputs=sample, data_format=fmt)
        if got is None or len(got) != len(out_names):
            raise BuildFailure("inference", f"simulator returned {got!r:.200}")
        for slot, arr in zip(outs, got, strict=True):
            slot.append(np.asarray(arr, dtype=np.float32))
    tmp_out = sim_out.parent / f".{sim_out.stem}.{os.getpid()}.partial.npz"
    arrays = {n: np.stack(o) for n, o in zip(out_names, outs, strict=True)}
    # numpy's stub also matches **arrays against savez's allow_pickle: bool
    np.savez(tmp_out, **arrays)  # type: ignore[arg-type]
    os.replace(tmp_out, sim_out)


def configure_and_build(rk: Any, onnx_path: Path, in_names: list[str], *, quant: str,
                        target: str, algorithm: str, hybrid_cos: float | None,
                        dynamic_input: str | None, calibration: str | None,
                        workdir: Path) -> None:
    """config + load_onnx + build on ``rk`` (also used by rknn_sim_server.py)."""
    if quant == "w8a8" and not calibration:
        raise BuildFailure("config", "w8a8 needs a calibration set of real inputs")
    cfg: dict[str, Any] = {"target_platform": target}
    if quant == "w8a8":
        cfg.update(quantized_dtype="w8a8", quantized_method="channel",
                   quantized_algorithm=algorithm)
        if hybrid_cos is not None:
            cfg["auto_hybrid_cos_thresh"] = hybrid_cos
    if dynamic_input:
        cfg["dynamic_input"] = json.loads(dynamic_input)
    _check(rk.config(**cfg), "config")
    _check(rk.load_onnx(model=str(onnx_path)), "load_onnx")
    dataset = None
    if quant == "w8a8" and calibration:  # (checked above: w8a8 has one)
        calib = _load_samples(Path(calibration), in_names, "calibration")
        dataset = str(_write_dataset(calib, workdir))
    # auto_hybrid: the toolkit runs the calibration set through the fp32 and the
    # quantized graph and keeps in fp16 the ops whose output cosine falls below
    # auto_hybrid_cos_thresh; the rest stays int8.
    _check(rk.build(do_quantization=quant == "w8a8", dataset=dataset,
                    auto_hybrid=hybrid_cos is not None), "build")


def build(args: argparse.Namespace) -> dict:
    from rknn.api import RKNN

    onnx_path, out_path = Path(args.onnx), Path(args.out)
    in_names, out_names = _graph_io(onnx_path)
    result: dict = {"ok": False, "quant": args.quant, "target": args.target,
                    "inputs": in_names, "outputs": out_names}
    rk = RKNN(verbose=args.verbose)
    try:
        with tempfile.TemporaryDirectory(prefix="rknn-build-") as tmp:
            t0 = time.perf_counter()
            configure_and_build(rk, onnx_path, in_names, quant=args.quant,
                                target=args.target, algorithm=args.algorithm,
                                hybrid_cos=args.hybrid_cos, dynamic_input=args.dynamic_input,
                                calibration=args.calibration, workdir=Path(tmp))
            t2 = time.perf_counter()
            partial = out_path.parent / f".{out_path.stem}.{os.getpid()}.partial.rknn"
            try:
                _check(rk.export_rknn(str(partial)), "export_rknn")
                os.replace(partial, out_path)
            finally:
                partial.unlink(missing_ok=True)
            result.update(build_s=t2 - t0, bytes=out_path.stat().st_size)
            if args.simulate:
                _check(rk.init_runtime(), "init_runtime")
                t3 = time.perf_counter()
                for sim_in, sim_out in zip(args.simulate, args.sim_out, strict=True):
                    _simulate(rk, Path(sim_in), Path(sim_out), in_names, out_names)
                result["sim_s"] = time.perf_counter() - t3
    finally:
        rk.release()
    result["ok"] = True
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--quant", choices=QUANT_TYPES, required=True)
    p.add_argument("--target", default="rk3588")
    p.add_argument("--algorithm", default="normal", choices=("normal", "mmse", "kl_divergence"))
    p.add_argument("--hybrid-cos", type=float, default=None,
                   help="w8a8: keep in fp16 the ops whose calibration cosine is below this")
    p.add_argument("--calibration")
    p.add_argument("--dynamic-input", help="JSON list of input shape sets")
    p.add_argument("--simulate", action="append", default=[],
                   help="npz of inputs to simulate (repeatable: one per shape set)")
    p.add_argument("--sim-out", action="append", default=[])
    p.add_argument("--result")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if len(args.simulate) != len(args.sim_out):
        p.error("every --simulate needs its --sim-out")
    try:
        result = build(args)
    except BuildFailure as exc:
        result = {"ok": False, "step": exc.step, "error": str(exc)}
    except Exception as exc:  # rknn raises ValueError/RuntimeError/... from deep inside
        result = {"ok": False, "step": "rknn", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    text = json.dumps(result)
    if args.result:
        Path(args.result).write_text(text)
    print("RESULT " + text, flush=True)
    return 0 if result["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())

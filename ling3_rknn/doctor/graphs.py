"""The bundle: verified, its graphs loaded on the NPU cores the placement names, timed.

On an RK3588 the graphs go through rknnlite, exactly as ``serve`` loads them; on any
other machine through the onnxruntime mock, which proves the ONNX twins load but times
the host CPU, not the NPU.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ling3_rknn.bundle import PLACEHOLDER_MAGIC, Bundle, BundleError, VerifyMode
from ling3_rknn.doctor.report import Check

NPU_WINDOW_BYTES = 4 << 30  # RKNNLite models share one ~4 GB address window
EMPTY_GRAPH_SHAPE = (1, 1, 8)  # the documented empty graph: one Add over [1, 1, 8]
_COMPILER = re.compile(rb"(\d+\.\d+\.\d+)[^\x00(]{0,16}\(compiler version")


def latency(run: Callable[..., Any], feeds: list[np.ndarray], runs: int
            ) -> tuple[float, float]:
    """Median and p90 (nearest rank) in ms of ``runs`` calls after one warm-up call."""
    run(*feeds)  # warm-up: the first call allocates
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run(*feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[max(0, math.ceil(0.9 * len(times)) - 1)]


def starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:  # not read_bytes(): the lm_head graph is ~0.5 GB
        return f.read(len(magic)) == magic


def toolkit_version(bundle: Bundle) -> str | None:
    """The rknn-toolkit2 version that built the ``.rknn`` files (their header says)."""
    for spec in bundle.manifest.stages.values():
        if spec.rknn is None:
            continue
        try:
            with open(bundle.path(spec.rknn), "rb") as f:
                match = _COMPILER.search(f.read(1 << 20))
        except OSError:
            continue
        if match:
            return match.group(1).decode()
    return None


def open_bundle(path: Path, quick: bool, full: bool = False) -> tuple[Bundle | None, Check]:
    """The bundle verified by size (``quick``), by its remembered sha256 stamp, or hashed
    anew (``full``)."""
    verify: VerifyMode = "full" if full else "size" if quick else "stamped"
    try:
        bundle = Bundle.open(path, verify=verify)
    except BundleError as exc:
        return None, Check("bundle", "fail", str(exc), fix="re-copy the bundle from the "
                           "conversion host (rsync -a OUT_DIR board:/opt/ling3-rknn/bundles/)")
    m = bundle.manifest
    npu_bytes = sum(s.nbytes for s in m.stages.values())
    toolkit = toolkit_version(bundle)
    data = {"path": str(path), "target": m.target, "verified": verify, "toolkit": toolkit,
            "npu_bytes": npu_bytes, "file_bytes": bundle_bytes(bundle)}
    built = f"built by rknn-toolkit2 {toolkit}, " if toolkit else ""
    detail = (f"{path} (target {m.target}, {built}{len(m.stages)} graphs, "
              f"{npu_bytes / 2**20:.1f} MiB on the NPU, files checked by "
              f"{'size' if verify == 'size' else 'sha256'})")
    if m.target != "rk3588":
        return bundle, Check("bundle", "fail", detail + ": a --target cpu bundle has no NPU "
                             "graphs", fix="ling3-rknn convert HF_DIR OUT_DIR --target rk3588",
                             data=data)
    if npu_bytes > NPU_WINDOW_BYTES:
        return bundle, Check("bundle", "fail", detail + ": more than the ~4 GiB NPU window",
                             fix="re-convert with a smaller --npu-budget", data=data)
    return bundle, Check("bundle", "ok", detail, data=data)


def bundle_bytes(bundle: Bundle) -> int:
    return sum(entry.size for entry in bundle.manifest.files.values())


def sequence_bytes(bundle: Bundle) -> int:
    """One sequence's state at serve's defaults (the context limit, a float32 latent
    cache): what the memory plan keeps for it."""
    from ling3_rknn.config import ModelConfig
    from ling3_rknn.loading import DEFAULT_MAX_CONTEXT
    from ling3_rknn.model.state import StateLayout

    config = ModelConfig.from_dict(bundle.manifest.model_config)
    context = min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    return StateLayout.from_config(config).nbytes(context)


def load_graphs(bundle: Bundle, rknnlite_cls: type, on_board: bool, runs: int | None
                ) -> list[Check]:
    """Every stage on its cores; with ``runs``, median latency at T = 1 and the chunk."""
    from ling3_rknn.npu import NpuError, RknnLiteExecutor

    m = bundle.manifest
    checks: list[Check] = []
    rows: dict[str, dict[str, Any]] = {}
    for name, spec in m.stages.items():
        core = m.placement.stage_cores.get(name, "auto")
        if spec.rknn is None:
            checks.append(Check(f"graph {name}", "fail", "the manifest names no .rknn file"))
            continue
        path = bundle.path(spec.rknn)
        if on_board and starts_with(path, PLACEHOLDER_MAGIC):
            checks.append(Check(f"graph {name}", "fail", f"{spec.rknn} is a placeholder from "
                                "a conversion without rknn-toolkit2",
                                fix="re-convert on the host with the toolkit (make rknn-env)"))
            continue
        try:
            ex = RknnLiteExecutor(path, spec, core_mask=core, rknnlite_cls=rknnlite_cls)
            try:
                timed: dict[str, float] = {}
                tail: dict[str, float] = {}
                row: dict[str, Any] = {"core": core, "median_ms": timed, "p90_ms": tail}
                dtype = np.float16 if spec.input_dtype == "float16" else np.float32
                calls = runs or 0
                for group in spec.shape_sets if calls else ():
                    rng = np.random.default_rng(0)
                    feeds = [rng.normal(size=s).astype(dtype) for s in group]
                    med, p90 = latency(ex.run, feeds, calls)
                    timed[f"T={group[0][1]}"] = round(med, 4)
                    tail[f"T={group[0][1]}"] = round(p90, 4)
            finally:
                ex.close()
        except (NpuError, OSError, RuntimeError, ValueError) as exc:
            checks.append(Check(f"graph {name}", "fail", f"does not load on core {core}: {exc}",
                                fix="librknnrt at least as new as the toolkit that built it"))
            continue
        rows[name] = row
    where = "NPU" if on_board else "onnxruntime mock (host CPU)"
    checks.insert(0, Check("graphs", "ok" if len(rows) == len(m.stages) else "fail",
                           f"{len(rows)} of {len(m.stages)} loaded on the {where}",
                           data={"stages": rows}))
    dense = [r["median_ms"]["T=1"] for n, r in rows.items()
             if ".expert." not in n and "T=1" in r["median_ms"]]
    if dense:
        checks.append(Check("latency", "ok", f"decode floor {sum(dense):.1f} ms per token over "
                            f"{len(dense)} dense graphs at T=1 (median of {runs}; {where})",
                            data={"ms_per_token": round(sum(dense), 4), "calls": len(dense)}))
    return checks


def empty_graph(path: Path, rknnlite_cls: type, runs: int) -> Check:
    """The fixed cost of one NPU call, and the runtime's version, from a graph that does
    nothing: one Add over ``EMPTY_GRAPH_SHAPE``, built on the host with
    ``convert.rknn_toolkit.build_rknn`` (docs/toolchain.md 5)."""
    lite = rknnlite_cls(verbose=False)
    try:
        if lite.load_rknn(str(path)) != 0 or lite.init_runtime() != 0:
            return Check("empty graph", "fail", f"{path} did not load (see the RKNNLite log "
                         "above)", fix="build it on the host: one Add over "
                         f"{list(EMPTY_GRAPH_SHAPE)} (convert.rknn_toolkit.build_rknn)")
        sdk = lite.get_sdk_version()

        def call(x: np.ndarray) -> None:
            if lite.inference(inputs=[x]) is None:
                raise RuntimeError("inference returned None (see the RKNNLite log)")

        try:
            med, p90 = latency(call, [np.zeros(EMPTY_GRAPH_SHAPE, np.float32)], runs)
        except RuntimeError as exc:
            return Check("empty graph", "fail", f"{path}: {exc}; it must take one "
                         f"{list(EMPTY_GRAPH_SHAPE)} input", data={"sdk": sdk})
        return Check("empty graph", "ok", f"{med:.3f} ms median, {p90:.3f} ms p90 per call "
                     f"(runtime {sdk})",
                     data={"sdk": sdk, "median_ms": round(med, 4), "p90_ms": round(p90, 4)})
    finally:
        lite.release()

"""Graph executors: run one NPU stage graph with inputs/outputs in its declared order.

* :class:`RknnLiteExecutor` - the board path: one ``RKNNLite`` runtime per graph, pinned
  to the cores the placement plan names. The ``RKNNLite`` class is resolved by
  :func:`resolve_rknnlite` (real module on the board, the ONNX-twin mock elsewhere; an
  explicit choice wins), so host tests drive exactly this code.
* :class:`OnnxExecutor` - plain onnxruntime on the ONNX twin, for ``--target cpu``.

Both validate inputs against the graph's declared shape sets before calling into the
runtime and turn every runtime failure into a typed :class:`NpuError`. They know graphs
and tensors only: a :class:`GraphSpec` is anything with the fields below (the bundle's
``StageSpec`` is one), so this package never imports the bundle format.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ling3_rknn.cpu_threads import is_rk3588, pool_worker_cores
from ling3_rknn.npu.errors import NpuError, NpuInputError
from ling3_rknn.npu.rknnlite_mock import MockRKNNLite

log = logging.getLogger(__name__)

RUNTIME_ENV = "LING3_NPU_RUNTIME"  # "board" | "mock" | "auto"
CORE_MASKS = {"auto": 0, "0": 1, "1": 2, "2": 4, "0_1": 3, "0_1_2": 7, "all": 0xFFFF}
# Where rknn-toolkit-lite2 loads Rockchip's C runtime from (the wheel does not ship it;
# docs/board-guide.md section 2).
LIBRKNNRT = Path("/usr/lib/librknnrt.so")


class GraphSpec(Protocol):
    """What an executor needs to know about a static-shape graph.

    ``shape_sets`` lists every static shape combination the graph accepts, one shape per
    input (rknn-toolkit2's ``dynamic_input`` layout)."""

    @property
    def name(self) -> str: ...

    @property
    def inputs(self) -> tuple[str, ...]: ...

    @property
    def outputs(self) -> tuple[str, ...]: ...

    @property
    def shape_sets(self) -> tuple[tuple[tuple[int, ...], ...], ...]: ...

    @property
    def input_dtype(self) -> str: ...


class GraphExecutor(Protocol):
    spec: GraphSpec

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def resolve_rknnlite(choice: str | None = None) -> type:
    """The ``RKNNLite`` class to use: ``choice`` or ``$LING3_NPU_RUNTIME`` or ``auto``.

    ``auto`` takes the real runtime when ``rknnlite`` imports and otherwise the mock,
    with a warning on an ARM machine (where a missing runtime is a setup error, not a
    host test).
    """
    choice = choice or os.environ.get(RUNTIME_ENV) or "auto"
    if choice == "mock":
        return MockRKNNLite
    if choice not in ("board", "auto"):
        raise NpuError(f"unknown NPU runtime {choice!r}; use board, mock or auto")
    try:
        from rknnlite.api import RKNNLite
    except ImportError as exc:
        if choice == "board":
            raise NpuError("rknn-toolkit-lite2 is not installed (pip install "
                           "'ling3-rknn[board]'; librknnrt.so must be in /usr/lib)") from exc
        if platform.machine() in ("aarch64", "armv7l"):
            log.warning("rknnlite not importable on %s: running NPU graphs on the CPU mock",
                        platform.machine())
        return MockRKNNLite
    return RKNNLite


def runtime_problem(cls: type, librknnrt: Path = LIBRKNNRT, compatible: Path | None = None
                    ) -> str:
    """Why a real ``RKNNLite`` cannot start here, in the words ``ling3-rknn doctor`` uses:
    RKNNLite itself only logs a traceback (its SoC probe fails first off an RK3588, then
    the library lookup), which a service's journal shows far from the error."""
    if cls is MockRKNNLite:
        return "see the log above"
    if not librknnrt.exists():
        return (f"{librknnrt} is missing: rknn-toolkit-lite2 needs Rockchip's runtime "
                "library, which its wheel does not ship; install librknnrt.so from the "
                "rknn-toolkit2 release that built the bundle into /usr/lib "
                "(docs/board-guide.md section 2, `ling3-rknn doctor` prints the command)")
    if not (is_rk3588() if compatible is None else is_rk3588(compatible)):
        return (f"this machine ({platform.machine()}) is not an RK3588 (the device tree "
                "names no rockchip,rk3588): RKNNLite runs on the board only; "
                f"{RUNTIME_ENV}=mock runs the graphs' ONNX twins on the CPU")
    return "see the RKNNLite log above"


def check_inputs(spec: GraphSpec, inputs: Sequence[np.ndarray]) -> int:
    """Validate count, dtype and shape; returns the index of the matching shape set."""
    if len(inputs) != len(spec.inputs):
        raise NpuInputError(f"stage {spec.name!r} takes {len(spec.inputs)} inputs "
                            f"{list(spec.inputs)}, got {len(inputs)}")
    for name, x in zip(spec.inputs, inputs, strict=True):
        if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
            raise NpuInputError(f"stage {spec.name!r} input {name!r} must be a float numpy "
                                f"array, got {getattr(x, 'dtype', type(x).__name__)}")
    shapes = tuple(tuple(x.shape) for x in inputs)
    for i, group in enumerate(spec.shape_sets):
        if shapes == group:
            return i
    raise NpuInputError(f"stage {spec.name!r} got input shapes {list(shapes)}; it was built "
                        f"for {[list(g) for g in spec.shape_sets]}")


def _feed_dtype(spec: GraphSpec) -> type:
    return np.float16 if spec.input_dtype == "float16" else np.float32


class RknnLiteExecutor:
    """One RKNNLite runtime for one ``.rknn`` graph."""

    def __init__(self, rknn_path: str | os.PathLike[str], spec: GraphSpec,
                 core_mask: str | int = "auto", rknnlite_cls: type | None = None) -> None:
        self.spec = spec
        self.path = Path(rknn_path)
        mask = CORE_MASKS.get(core_mask) if isinstance(core_mask, str) else core_mask
        if mask is None:
            raise NpuError(f"unknown core mask {core_mask!r}; use one of {list(CORE_MASKS)}")
        self.core_mask = mask
        cls = rknnlite_cls or resolve_rknnlite()
        self.runtime_name = cls.__name__
        self._lite: Any = cls(verbose=False)
        ret = self._lite.load_rknn(str(self.path))
        if ret != 0:
            raise NpuError(f"load_rknn({str(self.path)!r}) failed with {ret}")
        ret = self._lite.init_runtime(core_mask=mask)
        if ret != 0:
            self._lite.release()
            raise NpuError(f"init_runtime(core_mask={mask}) for {self.path.name} failed "
                           f"with {ret}: {runtime_problem(cls)}")
        self._dtype = _feed_dtype(spec)

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        check_inputs(self.spec, inputs)
        feeds: list[np.ndarray] = [np.ascontiguousarray(x, dtype=self._dtype) for x in inputs]
        fmt = ["nchw"] * len(feeds) if any(x.ndim == 4 for x in feeds) else None
        outputs = self._lite.inference(inputs=feeds, data_format=fmt)
        if outputs is None:
            raise NpuError(f"inference on {self.path.name} failed (see the RKNNLite log)")
        if len(outputs) != len(self.spec.outputs):
            raise NpuError(f"{self.path.name} returned {len(outputs)} outputs, manifest "
                           f"declares {list(self.spec.outputs)}")
        return [np.asarray(o, dtype=np.float32) for o in outputs]

    def close(self) -> None:
        self._lite.release()


def cpu_session_options(threads: int) -> Any:
    """onnxruntime session options for a CPU pool of ``threads`` under the process's
    thread policy (``ling3_rknn.cpu_threads``): no inter-op pool, workers that never spin
    (a spinning worker steals the core the NPU driver and the other pools need) and, with
    a policy in force, each worker pinned to its own core (``pool_worker_cores``)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    cores = pool_worker_cores(threads)
    if cores:  # onnxruntime numbers logical processors from 1
        opts.add_session_config_entry("session.intra_op_thread_affinities",
                                      ";".join(str(c + 1) for c in cores))
    return opts


class OnnxExecutor:
    """The ONNX twin on onnxruntime's CPU provider (``--target cpu`` bundles)."""

    def __init__(self, onnx_path: str | os.PathLike[str], spec: GraphSpec, threads: int = 1
                 ) -> None:
        import onnxruntime as ort

        self.spec = spec
        self.path = Path(onnx_path)
        opts = cpu_session_options(threads)
        try:
            self._session = ort.InferenceSession(str(self.path), sess_options=opts,
                                                 providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise NpuError(f"cannot load {self.path.name}: {exc}") from exc
        names = [i.name for i in self._session.get_inputs()]
        outs = [o.name for o in self._session.get_outputs()]
        if names != list(spec.inputs) or outs != list(spec.outputs):
            raise NpuError(f"{self.path.name} has inputs {names} / outputs {outs}; manifest "
                           f"declares {list(spec.inputs)} / {list(spec.outputs)}")

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        check_inputs(self.spec, inputs)
        feeds = {n: np.ascontiguousarray(x, dtype=np.float32)
                 for n, x in zip(self.spec.inputs, inputs, strict=True)}
        try:
            return self._session.run(list(self.spec.outputs), feeds)
        except Exception as exc:
            raise NpuError(f"onnxruntime failed on {self.path.name}: {exc}") from exc

    def close(self) -> None:
        self._session = None

"""A host stand-in for ``rknnlite.api.RKNNLite`` that runs each graph's ONNX twin.

Same constructor, methods, constants, return codes and failure style as rknn-toolkit-lite2
2.5.0 (``load_rknn``/``init_runtime`` return 0 or -1 and log; ``inference`` logs and returns
``None``; 4-D inputs are read as NHWC unless ``data_format='nchw'``), so the board code path
(:class:`ling3_rknn.npu.executors.RknnLiteExecutor`) runs unchanged in host tests. Given
``x.rknn`` it executes ``x.onnx`` next to it with onnxruntime; the ``.rknn`` itself is only
read, as the real runtime does at ``load_rknn``.

It also counts calls per class (:attr:`MockRKNNLite.stats`), which is how the NPU calls
per token of a plan are measured on the host.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Any, ClassVar

import numpy as np

log = logging.getLogger(__name__)

_VALID_CORE_MASKS = {0, 1, 2, 4, 3, 7, 0xFFFF}  # RK3588
_DTYPES = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16, "float16": np.float16,
           "float32": np.float32}


class MockRKNNLite:
    NPU_CORE_AUTO = 0
    NPU_CORE_0 = 1
    NPU_CORE_1 = 2
    NPU_CORE_2 = 4
    NPU_CORE_0_1 = 3
    NPU_CORE_0_1_2 = 7
    NPU_CORE_ALL = 0xFFFF

    stats: ClassVar[Counter[str]] = Counter()  # "inference", "inference:<model file>", ...
    _stats_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, verbose: bool = False, verbose_file: str | None = None) -> None:
        self.verbose = verbose
        self.rknn_path: str | None = None
        self.rknn_data: bytes | None = None
        self.core_mask: int | None = None
        self._session: Any = None
        self._in_names: list[str] = []
        self._in_shapes: list[list[object]] = []
        self._out_names: list[str] = []

    @classmethod
    def reset_stats(cls) -> None:
        with cls._stats_lock:
            cls.stats.clear()

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1
            self.stats[f"{key}:{os.path.basename(self.rknn_path or '?')}"] += 1

    def load_rknn(self, path: str, key_path: str | None = None) -> int:
        if not path or not os.path.exists(path):
            log.error("Invalid RKNN model path: %s", path or "None")
            return -1
        try:
            with open(path, "rb") as f:
                self.rknn_data = f.read()
        except OSError as exc:
            log.error("Catch exception when loading RKNN model [%s]! %s", path, exc)
            return -1
        self.rknn_path = path
        return 0

    def init_runtime(self, target: str | None = None, device_id: str | None = None,
                     async_mode: bool = False, core_mask: int = NPU_CORE_AUTO) -> int:
        if target is not None:
            log.error("mock RKNNLite has no device %r (it runs the ONNX twin locally)", target)
            return -1
        if self.rknn_data is None or self.rknn_path is None:
            log.error("Model is not loaded yet, this interface should be called after load_rknn!")
            return -1
        if core_mask not in _VALID_CORE_MASKS:
            log.error("Catch exception when set npu core mode: invalid core mask %r", core_mask)
            return -1
        twin = os.path.splitext(self.rknn_path)[0] + ".onnx"
        if not os.path.exists(twin):
            log.error("Catch exception when init runtime! no ONNX twin %s", twin)
            return -1
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1  # one NPU core: one graph at a time, no thread fan-out
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.release()
        try:
            self._session = ort.InferenceSession(twin, sess_options=opts,
                                                 providers=["CPUExecutionProvider"])
        except Exception as exc:
            log.error("Catch exception when init runtime! %s", exc)
            return -1
        self._in_names = [i.name for i in self._session.get_inputs()]
        self._in_shapes = [list(i.shape) for i in self._session.get_inputs()]
        self._out_names = [o.name for o in self._session.get_outputs()]
        self.core_mask = core_mask
        return 0

    def _set_inputs(self, inputs: list[np.ndarray], data_type: str | list[str] | None,
                    data_format: str | list[str] | None) -> dict[str, np.ndarray]:
        if not isinstance(inputs, (list, tuple)):
            raise TypeError("inputs must be a list of numpy arrays")
        if len(inputs) != len(self._in_names):
            raise ValueError(f"The number of inputs is wrong: expect {len(self._in_names)}, "
                             f"got {len(inputs)}")
        feeds = {}
        for i, (name, want, x) in enumerate(zip(self._in_names, self._in_shapes, inputs,
                                                strict=True)):
            arr = np.asarray(x)
            dt = data_type[i] if isinstance(data_type, (list, tuple)) else data_type
            if dt is not None:
                if dt not in _DTYPES:
                    raise ValueError(f"data_type {dt!r} not supported")
                arr = arr.astype(_DTYPES[dt], copy=False)
            fmt = data_format[i] if isinstance(data_format, (list, tuple)) else data_format
            if arr.ndim == 4 and fmt != "nchw":
                arr = arr.transpose(0, 3, 1, 2)  # the runtime's NHWC default
            if len(want) != arr.ndim or any(
                    isinstance(w, int) and w != a for w, a in zip(want, arr.shape, strict=True)):
                raise ValueError(f"The input shape {tuple(np.asarray(x).shape)} of {name!r} "
                                 f"is wrong, expect {want}!")
            feeds[name] = np.ascontiguousarray(arr, dtype=np.float32)
        return feeds

    def inference(self, inputs: list[np.ndarray], data_type: str | None = None,
                  data_format: str | list[str] | None = None,
                  inputs_pass_through: list[int] | None = None, get_frame_id: bool = False,
                  reuse_outputs: bool = False) -> list[Any] | None:
        if self._session is None:
            log.error("Runtime environment is not inited, please call init_runtime first!")
            return None
        try:
            feeds = self._set_inputs(inputs, data_type, data_format)
        except Exception as exc:
            log.error("Catch exception when setting inputs. %s", exc)
            return None
        try:
            outputs = self._session.run(self._out_names, feeds)
        except Exception as exc:
            log.error("Catch exception when running RKNN model. %s", exc)
            return None
        self._count("inference")
        # the outputs, then (get_frame_id) the frame id, an int, as RKNNLite returns them
        result: list[Any] = [np.asarray(o, dtype=np.float32) for o in outputs]
        if get_frame_id:
            result.append(0)
        return result

    def get_sdk_version(self) -> str | None:
        if self._session is None:
            log.error("Runtime environment is not inited, please call init_runtime first!")
            return None
        return "mock (onnxruntime twin)"

    def list_support_target_platform(self, rknn_model: str | None = None) -> dict | None:
        if rknn_model is not None and not os.path.exists(rknn_model):
            log.error("The model %s does not exist.", rknn_model)
            return None
        return {"support_target_platform": ["rk3588"], "filled_target_platform": ["rk3588"]}

    def release(self) -> None:
        self._session = None

"""Routed experts of one MoE layer on onnxruntime's QMoE CPU kernel.

Every expert executor shares one call signature ``run(hidden [T, D], expert_ids [T, k],
expert_weights [T, k]) -> [T, D]``; routing (sigmoid scores, bias, group-limited top-k,
renormalisation, scaling) is done by the model in numpy before the call.

* :class:`QMoeExperts` - the default: int4/int8 block-quantized weights run by
  onnxruntime's ``com.microsoft::QMoE`` op, one graph per MoE layer (written by the
  converter; weights live in the bundle's safetensors). The kernel reads packed weights
  directly, so no int4 is ever unpacked in Python (docs/performance.md, "Routed experts
  on the CPU": 15x faster than numpy at prefill).

The numpy float executor for ``--experts fp16`` bundles is model code
(``ling3_rknn.model.float_experts``): it is the model's own SwiGLU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ling3_rknn.npu.errors import ExpertError
from ling3_rknn.npu.executors import cpu_session_options

# The selection mask handed to QMoE as ``router_probs``: QMoE takes the top-k of it, so
# selected experts must dominate every other entry whatever k is.
_SELECTED_LOGIT = 10.0
_UNSELECTED_LOGIT = -1.0e4


class ExpertExecutor(Protocol):
    """Runs the routed experts of one MoE layer for already-routed tokens."""

    @property
    def num_experts(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    def run(
        self, hidden: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray
    ) -> np.ndarray: ...


@dataclass(frozen=True)
class PackedExperts:
    """Block-quantized routed experts in the raw layout onnxruntime's QMoE reads.

    ``fc1`` holds gate and up interleaved by row (``[g0, u0, g1, u1, ...]``, the only
    SwiGLU layout the CPU kernel accepts); rows are output features, packed along the
    input dimension with the low nibble holding the even element. Symmetric: the implied
    zero point is 8 (int4) or 128 (int8).
    """

    bits: int
    block_size: int
    fc1_weight: np.ndarray  # uint8 [E, 2I, D * bits / 8]
    fc1_scales: np.ndarray  # float32 [E, 2I, D / block_size]
    fc2_weight: np.ndarray  # uint8 [E, D, I * bits / 8]
    fc2_scales: np.ndarray  # float32 [E, D, I / block_size]

    TENSOR_NAMES = ("fc1_weight", "fc1_scales", "fc2_weight", "fc2_scales")

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ExpertError(f"expert weight bits must be 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ExpertError(f"block size must be a power of two >= 16, got {self.block_size}")
        for name in ("fc1_weight", "fc2_weight"):
            arr = getattr(self, name)
            if arr.dtype != np.uint8 or arr.ndim != 3:
                raise ExpertError(f"{name} must be uint8 [E, N, K*bits/8], got {arr.dtype} "
                                  f"{arr.shape}")
        for name in ("fc1_scales", "fc2_scales"):
            arr = getattr(self, name)
            if arr.dtype != np.float32 or arr.ndim != 3:
                raise ExpertError(f"{name} must be float32 [E, N, K/block], got {arr.dtype} "
                                  f"{arr.shape}")
        e, two_i, packed_d = self.fc1_weight.shape
        d = packed_d * 8 // self.bits
        i = two_i // 2
        expected = {
            "fc1_weight": (e, 2 * i, d * self.bits // 8),
            "fc1_scales": (e, 2 * i, d // self.block_size),
            "fc2_weight": (e, d, i * self.bits // 8),
            "fc2_scales": (e, d, i // self.block_size),
        }
        if two_i % 2 or d % self.block_size or i % self.block_size:
            raise ExpertError(
                f"hidden {d} and intermediate {i} must be multiples of block {self.block_size}"
            )
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ExpertError(f"{name} has shape {getattr(self, name).shape}, expected "
                                  f"{shape} for E={e} D={d} I={i} bits={self.bits}")

    @property
    def num_experts(self) -> int:
        return int(self.fc1_weight.shape[0])

    @property
    def intermediate_size(self) -> int:
        return int(self.fc1_weight.shape[1] // 2)

    @property
    def hidden_size(self) -> int:
        return int(self.fc2_weight.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(self, n).nbytes) for n in self.TENSOR_NAMES)

    def tensors(self, prefix: str = "") -> dict[str, np.ndarray]:
        """The four arrays keyed for a safetensors file."""
        return {prefix + n: np.ascontiguousarray(getattr(self, n)) for n in self.TENSOR_NAMES}

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, np.ndarray], bits: int, block_size: int, prefix: str = ""
    ) -> PackedExperts:
        missing = [prefix + n for n in cls.TENSOR_NAMES if prefix + n not in tensors]
        if missing:
            raise ExpertError(f"packed experts lack tensors {missing}")
        return cls(bits, block_size, *(tensors[prefix + n] for n in cls.TENSOR_NAMES))


def check_routing(
    hidden: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray,
    hidden_size: int, num_experts: int, top_k: int,
) -> None:
    """Reject routing inputs the kernels would silently mis-handle."""
    if hidden.ndim != 2 or hidden.shape[1] != hidden_size:
        raise ExpertError(f"hidden must be [T, {hidden_size}], got {hidden.shape}")
    t = hidden.shape[0]
    if expert_ids.shape != (t, top_k) or expert_weights.shape != (t, top_k):
        raise ExpertError(
            f"expert_ids and expert_weights must be [{t}, {top_k}], got "
            f"{expert_ids.shape} and {expert_weights.shape}"
        )
    if expert_ids.dtype.kind not in "iu":
        raise ExpertError(f"expert_ids must be integers, got {expert_ids.dtype}")
    if t == 1:  # decode: k ids as Python ints check ~7x faster than four numpy reductions
        ids = expert_ids[0].tolist()
        if min(ids) < 0 or max(ids) >= num_experts:
            raise ExpertError(f"expert ids must lie in [0, {num_experts})")
        if len(set(ids)) != len(ids):
            raise ExpertError("an expert is selected twice for one token")
        return
    if t and (expert_ids.min() < 0 or expert_ids.max() >= num_experts):
        raise ExpertError(f"expert ids must lie in [0, {num_experts})")
    if t and top_k > 1:
        ordered = np.sort(expert_ids, axis=1)
        if (ordered[:, 1:] == ordered[:, :-1]).any():
            raise ExpertError("an expert is selected twice for one token")


class QMoeExperts:
    """One MoE layer's int4/int8 experts on onnxruntime's QMoE CPU kernel.

    ``model`` is the layer's ONNX graph as written by the converter (a path, whose
    external data - the packed weights - is resolved next to it, or serialized bytes).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        threads: int = 2,
    ) -> None:
        import onnxruntime as ort

        # no spinning, workers pinned per the thread policy (docs/performance.md)
        opts = cpu_session_options(threads)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        source = os.fspath(model) if not isinstance(model, bytes) else model
        try:
            self._session = ort.InferenceSession(
                source, sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own exception zoo
            raise ExpertError(f"cannot load QMoE graph: {exc}") from exc
        names = [i.name for i in self._session.get_inputs()]
        if names != ["hidden", "router_probs", "router_weights"]:
            raise ExpertError(f"QMoE graph has inputs {names}, expected hidden, "
                              "router_probs, router_weights")
        self._hidden_size = hidden_size
        self._num_experts = num_experts
        self._top_k = top_k
        self._output = [self._session.get_outputs()[0].name]

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def top_k(self) -> int:
        return self._top_k

    def run(
        self, hidden: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray
    ) -> np.ndarray:
        check_routing(hidden, expert_ids, expert_weights,
                      self._hidden_size, self._num_experts, self._top_k)
        t = hidden.shape[0]
        if t == 0:
            return np.zeros((0, self._hidden_size), np.float32)
        rows = np.arange(t)[:, None]
        probs = np.full((t, self._num_experts), _UNSELECTED_LOGIT, np.float32)
        probs[rows, expert_ids] = _SELECTED_LOGIT
        weights = np.zeros((t, self._num_experts), np.float32)
        weights[rows, expert_ids] = expert_weights
        feeds = {
            "hidden": np.ascontiguousarray(hidden, dtype=np.float32),
            "router_probs": probs,
            "router_weights": weights,
        }
        return self._session.run(self._output, feeds)[0]

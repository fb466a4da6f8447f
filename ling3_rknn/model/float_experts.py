"""Routed experts with fp16 or fp32 weights in numpy (``--experts fp16`` bundles).

The same SwiGLU as the model's dense FFN and :class:`~ling3_rknn.model.moe.NumpyExperts`
(``activations.silu``), behind the executor signature of the QMoE kernel
(``ling3_rknn.npu.ExpertExecutor``), so a bundle's layers can use either.
"""

from __future__ import annotations

import numpy as np

from ..npu.errors import ExpertError
from ..npu.experts import check_routing
from .activations import silu


class FloatExperts:
    """Routed experts of one MoE layer: ``gate``/``up`` ``[E, I, D]``, ``down`` ``[E, D, I]``.

    Tokens are grouped per selected expert so each expert's weights are read once per
    call; fp16 weights are widened one expert at a time to keep the extra memory small.
    """

    def __init__(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray, top_k: int) -> None:
        if gate.ndim != 3 or gate.shape != up.shape:
            raise ExpertError(f"gate and up must be equal [E, I, D], got {gate.shape}, "
                              f"{up.shape}")
        e, i, d = gate.shape
        if down.shape != (e, d, i):
            raise ExpertError(f"down must be [{e}, {d}, {i}], got {down.shape}")
        for arr in (gate, up, down):
            if arr.dtype not in (np.float16, np.float32):
                raise ExpertError(f"expert weights must be float16/float32, got {arr.dtype}")
        if not 1 <= top_k <= e:
            raise ExpertError(f"top_k {top_k} out of range for {e} experts")
        self._gate, self._up, self._down = gate, up, down
        self.top_k = top_k  # read-only by convention (``ExpertExecutor.top_k``)

    @property
    def num_experts(self) -> int:
        return int(self._gate.shape[0])

    def run(
        self, hidden: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray
    ) -> np.ndarray:
        d = self._gate.shape[2]
        check_routing(hidden, expert_ids, expert_weights, d, self.num_experts, self.top_k)
        x = hidden.astype(np.float32, copy=False)
        out = np.zeros_like(x)
        flat_ids = expert_ids.reshape(-1)
        token_of = np.repeat(np.arange(x.shape[0]), self.top_k)
        flat_w = expert_weights.reshape(-1).astype(np.float32)
        # weight-0 selections add nothing (the plan's NPU experts arrive that way): skip
        keep = flat_w != 0
        flat_ids, token_of, flat_w = flat_ids[keep], token_of[keep], flat_w[keep]
        order = np.argsort(flat_ids, kind="stable")
        experts, starts = np.unique(flat_ids[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        for n, e in enumerate(experts.tolist()):
            sel = order[bounds[n]:bounds[n + 1]]
            tokens = token_of[sel]
            xe = x[tokens]
            g = xe @ self._gate[e].astype(np.float32, copy=False).T
            u = xe @ self._up[e].astype(np.float32, copy=False).T
            y = (silu(g) * u) @ self._down[e].astype(np.float32, copy=False).T
            # check_routing guarantees a token picks an expert at most once: no repeats
            out[tokens] += y * flat_w[sel, None]
        return out

"""The stage seam: what the forward loop asks of whoever runs the NPU-shaped stages.

``NumpyStages`` runs the numpy references of ``stages.py`` with weights from a checkpoint.
An NPU executor (RKNN on the board, onnxruntime on the host) implements the same protocol
from a bundle, and ``Model`` does not change.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..config import ModelConfig
from .stages import (
    FinalWeights,
    KdaInputs,
    KdaInputWeights,
    LayerOutput,
    MlaInputs,
    MlaInputWeights,
    OutputWeights,
    final_stage,
    kda_input_stage,
    kda_output_stage,
    mla_input_stage,
    mla_output_stage,
)
from .weights import CheckpointWeights


class StageBackend(Protocol):
    """Runs the per-layer input/output stages and the final stage on a [T, ...] batch."""

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows [T, D] (a CPU table lookup on every backend)."""
        ...

    def kda_input(self, layer: int, x: np.ndarray) -> KdaInputs: ...

    def mla_input(self, layer: int, x: np.ndarray) -> MlaInputs: ...

    def kda_output(
        self, layer: int, x: np.ndarray, core: np.ndarray, out_gate: np.ndarray
    ) -> LayerOutput: ...

    def mla_output(
        self, layer: int, x: np.ndarray, ctx: np.ndarray, gate: np.ndarray
    ) -> LayerOutput: ...

    def final(self, x: np.ndarray) -> np.ndarray: ...


class NumpyStages:
    """Float32 numpy stages; weights are read from the checkpoint on first use and kept."""

    def __init__(self, weights: CheckpointWeights) -> None:
        self._w = weights
        self._cfg: ModelConfig = weights.cfg
        self._in: dict[int, KdaInputWeights | MlaInputWeights] = {}
        self._out: dict[int, OutputWeights] = {}
        self._final: FinalWeights | None = None

    def load_all(self) -> None:
        """Read and check every stage weight now (fail at load time, not mid-request)."""
        for i, kind in enumerate(self._cfg.layer_kinds):
            self._input_weights(i, kind)
            self._output_weights(i)
        self._final_weights()

    def _input_weights(self, i: int, kind: str) -> KdaInputWeights | MlaInputWeights:
        w = self._in.get(i)
        if w is None:
            w = self._w.kda_input(i) if kind == "kda" else self._w.mla_input(i)
            self._in[i] = w
        return w

    def _output_weights(self, i: int) -> OutputWeights:
        w = self._out.get(i)
        if w is None:
            w = self._out[i] = self._w.output(i)
        return w

    def _final_weights(self) -> FinalWeights:
        if self._final is None:
            self._final = self._w.final()
        return self._final

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._w.embedding_rows(ids)

    def kda_input(self, layer: int, x: np.ndarray) -> KdaInputs:
        w, c = self._input_weights(layer, "kda"), self._cfg
        assert isinstance(w, KdaInputWeights)  # the layer kind decides the weights' type
        return kda_input_stage(x, w, eps=c.rms_norm_eps, num_heads=c.num_attention_heads,
                               head_dim=c.kda_head_dim, safe_gate=c.kda_safe_gate,
                               lower_bound=c.kda_lower_bound)

    def mla_input(self, layer: int, x: np.ndarray) -> MlaInputs:
        w = self._input_weights(layer, "mla")
        assert isinstance(w, MlaInputWeights)
        c = self._cfg
        return mla_input_stage(x, w, eps=c.rms_norm_eps, num_heads=c.num_attention_heads,
                               qk_head_dim=c.qk_head_dim, kv_lora_rank=c.kv_lora_rank,
                               rope_dim=c.qk_rope_head_dim)

    def kda_output(
        self, layer: int, x: np.ndarray, core: np.ndarray, out_gate: np.ndarray
    ) -> LayerOutput:
        w = self._output_weights(layer)
        return kda_output_stage(x, core, out_gate, w, eps=self._cfg.rms_norm_eps)

    def mla_output(
        self, layer: int, x: np.ndarray, ctx: np.ndarray, gate: np.ndarray
    ) -> LayerOutput:
        w = self._output_weights(layer)
        return mla_output_stage(x, ctx, gate, w, eps=self._cfg.rms_norm_eps)

    def final(self, x: np.ndarray) -> np.ndarray:
        return final_stage(x, self._final_weights(), eps=self._cfg.rms_norm_eps)

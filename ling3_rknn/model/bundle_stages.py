"""The stage and expert seams served from a bundle: graph executors + CPU experts.

``GraphStages`` implements ``StageBackend`` over one executor per stage graph (RKNNLite on
the board or its ONNX-twin mock on the host, or plain onnxruntime). Graphs have static
shapes (T = 1 and T = chunk), so a batch of T tokens is cut into chunks and the last
piece zero-padded (every stage is row-wise, padded rows are dropped); a single token
takes the decode shape. Stage graphs return *deltas*; the residual adds are done here in
float32 (convert/stage_graphs.py explains why).

``BundleExperts`` implements ``ExpertBackend``: the layer's CPU executor (QMoE int4/int8
or float) for every selected expert, except those the placement plan put on the NPU,
which run as their own graphs on the tokens routed to them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..bundle import EMBEDDING_KEY, StageName
from ..config import ModelConfig
from ..npu import ExpertExecutor, GraphExecutor
from .safetensors_file import SafetensorsFile
from .stages import KdaInputs, LayerOutput, MlaInputs, kda_core_norm, safe_gate_log_decay


class GraphStages:
    """``StageBackend`` over per-stage graph executors (names as in the manifest)."""

    def __init__(self, config: ModelConfig, executors: Mapping[str, GraphExecutor],
                 weights: SafetensorsFile, chunk: int) -> None:
        self._cfg = config
        self._ex = dict(executors)
        self._w = weights
        self._chunk = chunk
        self.calls = 0  # graph executions, for the NPU-calls-per-token figure

    def replace_executors(self, executors: Mapping[str, GraphExecutor]) -> None:
        """Swap in other executors for named stages (same specs): host-side evaluation
        runs the dense work through rknn-toolkit2's simulator this way. The replaced ones
        are closed."""
        unknown = sorted(set(executors) - set(self._ex))
        if unknown:
            raise KeyError(f"no such stages: {unknown}")
        for name, ex in executors.items():
            self._ex[name].close()
            self._ex[name] = ex

    def run(self, name: str, *inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Inputs ``[T, width]`` -> outputs ``[T, width]`` by output name."""
        ex = self._ex[name]
        t = inputs[0].shape[0]
        if t == 1:
            return self._call(ex, inputs, 1)
        pieces = []
        for start in range(0, t, self._chunk):
            part = [x[start:start + self._chunk] for x in inputs]
            pieces.append(self._call(ex, part, self._chunk))
        return {k: np.concatenate([p[k] for p in pieces])[:t] for k in pieces[0]}

    def _call(self, ex: GraphExecutor, inputs: list[np.ndarray] | tuple[np.ndarray, ...],
              width: int) -> dict[str, np.ndarray]:
        n = inputs[0].shape[0]
        feeds = []
        for x in inputs:
            x = np.asarray(x, np.float32)
            if n < width:
                x = np.concatenate([x, np.zeros((width - n, x.shape[1]), np.float32)])
            feeds.append(x[None])
        self.calls += 1
        outs = ex.run(*feeds)
        return {name: o[0, :n] for name, o in zip(ex.spec.outputs, outs, strict=True)}

    # ------------------------------------------------------------------ StageBackend
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._w.float32_rows(EMBEDDING_KEY, ids)

    def kda_input(self, layer: int, x: np.ndarray) -> KdaInputs:
        c = self._cfg
        o = self.run(str(StageName.layer_in(layer)), x)
        shape = (x.shape[0], c.num_attention_heads, c.kda_head_dim)
        decay = (safe_gate_log_decay(o["forget_logit"], c.kda_lower_bound)
                 if "forget_logit" in o else o["log_decay"])
        return KdaInputs(qkv=o["qkv"], log_decay=decay.reshape(shape),
                         beta=o["beta"], out_gate=o["out_gate"].reshape(shape))

    def mla_input(self, layer: int, x: np.ndarray) -> MlaInputs:
        c = self._cfg
        o = self.run(str(StageName.layer_in(layer)), x)
        t, h = x.shape[0], c.num_attention_heads
        return MlaInputs(q_latent=o["q_latent"].reshape(t, h, c.kv_lora_rank),
                         q_rope=o["q_rope"].reshape(t, h, c.qk_rope_head_dim),
                         latent=o["latent"], k_rope=o["k_rope"], gate=o["gate"])

    def kda_output(self, layer: int, x: np.ndarray, core: np.ndarray, out_gate: np.ndarray
                   ) -> LayerOutput:
        t = x.shape[0]
        normed = kda_core_norm(core, self._cfg.rms_norm_eps)  # the graph's contract
        o = self.run(str(StageName.layer_out(layer)), x, normed.reshape(t, -1),
                     out_gate.reshape(t, -1))
        return self._layer_output(x, o)

    def mla_output(self, layer: int, x: np.ndarray, ctx: np.ndarray, gate: np.ndarray
                   ) -> LayerOutput:
        o = self.run(str(StageName.layer_out(layer)), x, ctx.reshape(x.shape[0], -1), gate)
        return self._layer_output(x, o)

    @staticmethod
    def _layer_output(x: np.ndarray, o: dict[str, np.ndarray]) -> LayerOutput:
        hidden = x + o["attn_delta"]  # the residual add, in float32 on the CPU
        if "ffn_delta" in o:
            return LayerOutput(hidden=hidden + o["ffn_delta"])
        shared = o.get("shared")
        return LayerOutput(hidden=hidden, moe_input=o["moe_input"],
                           shared=np.zeros_like(hidden) if shared is None else shared,
                           router_logits=o["router_logits"])

    def final(self, x: np.ndarray) -> np.ndarray:
        return self.run(str(StageName.final()), x)["logits"]


class BundleExperts:
    """``ExpertBackend``: CPU experts per MoE layer plus the plan's NPU experts."""

    def __init__(self, cpu: Mapping[int, ExpertExecutor],
                 npu: Mapping[int, Mapping[int, GraphExecutor]], stages: GraphStages) -> None:
        self._cpu = dict(cpu)
        self._npu = {layer: dict(ex) for layer, ex in npu.items() if ex}
        self._stages = stages

    def __call__(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray
                 ) -> np.ndarray:
        npu = self._npu.get(layer)
        if not npu:
            return self._cpu[layer].run(x, ids, weights)
        on_npu = np.isin(ids, list(npu))
        # NPU-placed selections get weight 0 on the CPU kernel: the float kernel skips
        # them, QMoE (k fixed by the graph) still computes them, which is why the
        # converter promotes no experts for int4/int8 unless told to (converter._place).
        if on_npu.all():
            out = np.zeros_like(x)
        else:
            out = self._cpu[layer].run(x, ids, np.where(on_npu, np.float32(0), weights))
        for e in np.unique(ids[on_npu]).tolist():
            tok, slot = np.nonzero(ids == e)
            y = self._stages.run(str(StageName.npu_expert(layer, e)), x[tok])["y"]
            out[tok] += weights[tok, slot][:, None] * y
        return out

"""The stage and expert seams served from a bundle: graph executors + CPU experts.

``GraphStages`` implements ``StageBackend`` over one executor per stage graph (RKNNLite on
the board or its ONNX-twin mock on the host, or plain onnxruntime). Graphs have static
shapes (T = 1 and one T per prefill chunk size the bundle was converted with), so a batch
of T tokens is cut into pieces of those sizes (``plan_pieces``: fewest padded rows plus a
per-call cost) and the last piece zero-padded (every stage is row-wise, padded rows are
dropped); a single token takes the decode shape. Each graph's inputs and outputs are
checked against the stage contract (``stage_contract.py``) once, when the stages are
built; afterwards outputs are read by position and finished by the contract's CPU half
(safe gate, residual adds).

``BundleExperts`` implements ``ExpertBackend``: the layer's CPU executor (QMoE int4/int8
or float) for every selected expert, except those the placement plan put on the NPU,
which run as their own graphs on the tokens routed to them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache

import numpy as np

from ..bundle import EMBEDDING_KEY, BundleError, StageName
from ..config import ModelConfig
from ..npu import ExpertExecutor, GraphExecutor
from ..npu.matmul_experts import MIN_TOKENS as PREFILL_MIN_TOKENS
from . import stage_contract as contract
from .safetensors_file import SafetensorsFile
from .stage_contract import KdaInputs, LayerOutput, MlaInputs

# What one more graph call costs, in rows of a stage's work. Unmeasured on a board until
# `doctor`'s `empty_graph.median_us` is taken there (docs/performance.md, prefill budget):
# a few hundred microseconds a call against tens of microseconds a row, so 16 rows is a
# floor that keeps a nearly full bigger graph ahead of several small ones.
CALL_COST_ROWS = 16


@cache
def plan_pieces(rows: int, sizes: tuple[int, ...], call_cost: int = CALL_COST_ROWS
                ) -> tuple[int, ...]:
    """The graph size of each consecutive piece covering ``rows`` rows: the cover with the
    fewest computed rows (padding included) plus ``call_cost`` per call. ``sizes`` sorted."""
    best: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    for n in range(1, rows + 1):
        options = []
        for s in sizes:
            cost, plan = best[max(0, n - s)]
            options.append((cost + s + call_cost, (*plan, s)))
        best.append(min(options))
    return best[rows][1]


class GraphStages:
    """``StageBackend`` over per-stage graph executors (names as in the manifest)."""

    def __init__(self, config: ModelConfig, executors: Mapping[str, GraphExecutor],
                 weights: SafetensorsFile, chunk_sizes: Sequence[int]) -> None:
        self._cfg = config
        for name, ex in executors.items():
            check_contract(config, name, ex)
        self._ex = dict(executors)
        self._w = weights
        # T = 1 is the decode shape every graph has; the others are prefill shapes
        self._sizes = tuple(sorted({int(c) for c in chunk_sizes if c > 1})) or (1,)
        self.calls = 0  # graph executions, for the NPU-calls-per-token figure

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The prefill shapes the graphs were built for, smallest first."""
        return self._sizes

    def replace_executors(self, executors: Mapping[str, GraphExecutor]) -> None:
        """Swap in other executors for named stages (same specs): host-side evaluation
        runs the dense work through rknn-toolkit2's simulator this way. The replaced ones
        are closed."""
        unknown = sorted(set(executors) - set(self._ex))
        if unknown:
            raise KeyError(f"no such stages: {unknown}")
        for name, ex in executors.items():
            check_contract(self._cfg, name, ex)
        for name, ex in executors.items():
            self._ex[name].close()
            self._ex[name] = ex

    def run(self, name: str, *inputs: np.ndarray) -> list[np.ndarray]:
        """Inputs ``[T, width]`` -> outputs ``[T, width]``, in the contract's order."""
        ex = self._ex[name]
        t = inputs[0].shape[0]
        if t == 1:
            return self._call(ex, inputs, 1)
        pieces, start = [], 0
        for size in plan_pieces(t, self._sizes):
            if start >= t:  # a cover never has an empty piece (tested); stay safe anyway
                break
            part = [x[start:start + size] for x in inputs]
            pieces.append(self._call(ex, part, size))
            start += size
        return [np.concatenate(parts)[:t] for parts in zip(*pieces, strict=True)]

    def _call(self, ex: GraphExecutor, inputs: list[np.ndarray] | tuple[np.ndarray, ...],
              width: int) -> list[np.ndarray]:
        n = inputs[0].shape[0]
        feeds = []
        for x in inputs:
            x = np.asarray(x, np.float32)
            if n < width:
                x = np.concatenate([x, np.zeros((width - n, x.shape[1]), np.float32)])
            feeds.append(x[None])
        self.calls += 1
        outs = ex.run(*feeds)
        return [o[0, :n] for o in outs]

    # ------------------------------------------------------------------ StageBackend
    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._w.float32_rows(EMBEDDING_KEY, ids)

    def kda_input(self, layer: int, x: np.ndarray) -> KdaInputs:
        c = self._cfg
        outputs = self.run(str(StageName.layer_in(layer)), x)
        return contract.finish_kda_input(
            outputs, num_heads=c.num_attention_heads, head_dim=c.kda_head_dim,
            safe_gate=c.kda_safe_gate, lower_bound=c.kda_lower_bound)

    def mla_input(self, layer: int, x: np.ndarray) -> MlaInputs:
        outputs = self.run(str(StageName.layer_in(layer)), x)
        return contract.finish_mla_input(outputs, num_heads=self._cfg.num_attention_heads)

    def kda_output(self, layer: int, x: np.ndarray, core: np.ndarray, out_gate: np.ndarray
                   ) -> LayerOutput:
        t = x.shape[0]
        normed = contract.kda_core_norm(core, self._cfg.rms_norm_eps)  # CPU half
        outputs = self.run(str(StageName.layer_out(layer)), x, normed.reshape(t, -1),
                           out_gate.reshape(t, -1))
        return contract.finish_output(x, outputs)

    def mla_output(self, layer: int, x: np.ndarray, ctx: np.ndarray, gate: np.ndarray
                   ) -> LayerOutput:
        outputs = self.run(str(StageName.layer_out(layer)), x, ctx.reshape(x.shape[0], -1),
                           gate)
        return contract.finish_output(x, outputs)

    def final(self, x: np.ndarray) -> np.ndarray:
        (logits,) = self.run(str(StageName.final()), x)
        return logits


def check_contract(config: ModelConfig, name: str, ex: GraphExecutor) -> None:
    """A graph whose inputs or outputs are not the contract's (by name, in order) cannot
    be read by position: a BundleError at load, never a wrong tensor later."""
    try:
        expected = contract.stage_contract(config, StageName.parse(name))
    except ValueError as exc:
        raise BundleError(f"stage {name!r}: {exc}") from None
    spec = ex.spec
    if (tuple(spec.inputs), tuple(spec.outputs)) != (expected.input_names,
                                                     expected.output_names):
        raise BundleError(f"stage {name!r} has inputs {list(spec.inputs)} / outputs "
                          f"{list(spec.outputs)}; the stage contract says "
                          f"{list(expected.input_names)} / {list(expected.output_names)}")


class BundleExperts:
    """``ExpertBackend``: CPU experts per MoE layer plus the plan's NPU experts, and for
    prefill pieces of at least ``prefill_min_tokens`` tokens the ``prefill`` executors (the
    int8 copy on the NPU's matmuls, ``ling3_rknn.npu.matmul_experts``) where loaded. Decode
    and short pieces keep the CPU executors."""

    def __init__(self, cpu: Mapping[int, ExpertExecutor],
                 npu: Mapping[int, Mapping[int, GraphExecutor]], stages: GraphStages, *,
                 prefill: Mapping[int, ExpertExecutor] | None = None,
                 prefill_min_tokens: int = PREFILL_MIN_TOKENS) -> None:
        self._cpu = dict(cpu)
        self._npu = {layer: dict(ex) for layer, ex in npu.items() if ex}
        self._stages = stages
        self.prefill = dict(prefill or {})
        self.prefill_min_tokens = prefill_min_tokens

    def __call__(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray
                 ) -> np.ndarray:
        if len(x) >= self.prefill_min_tokens and layer in self.prefill:
            return self.prefill[layer].run(x, ids, weights)
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
            (y,) = self._stages.run(str(StageName.npu_expert(layer, e)), x[tok])
            out[tok] += weights[tok, slot][:, None] * y
        return out

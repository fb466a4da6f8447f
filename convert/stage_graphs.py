"""The NPU stage graphs, built once from checkpoint weights as ONNX.

One builder per stage kind, mirroring the numpy references in
``ling3_rknn.model.stages`` op for op (tests/test_convert_stage_graphs.py holds them to
it). Every graph takes and returns 3-D ``[1, T, width]`` tensors with a symbolic ``T``:
the ONNX twin serves any T and the ``.rknn`` is built with two static shape sets, T = 1
for decode and T = chunk for prefill.

Every graph's inputs and outputs (names, widths, order) and the CPU work around it come
from the stage contract, ``ling3_rknn.model.stage_contract``; the builders only say how
the NPU computes them. The KDA forget logit is clipped to ``FORGET_LOGIT_RANGE`` (the
contract says why); the residual adds stay on the CPU in fp32 (convert/README.md,
finding 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from convert.onnx_ops import GraphBuilder
from ling3_rknn.bundle import StageName
from ling3_rknn.config import ModelConfig
from ling3_rknn.model.stage_contract import (
    FORGET_LOGIT_RANGE,
    LATENT_NORM_EPS,
    FfnKind,
    StageContract,
    expert_contract,
    final_contract,
    kda_input_contract,
    mla_input_contract,
    output_contract,
)
from ling3_rknn.model.stages import (
    DenseFfnWeights,
    FinalWeights,
    KdaInputWeights,
    MlaInputWeights,
    OutputWeights,
)

T = "T"  # the symbolic token axis of every ONNX twin
# rknn-toolkit2 2.5.0 leaves the transposed copy of a MatMul wider than ~8192 output columns
# on the board CPU (the 157184-wide lm_head: one CPU op per token); MatMuls of 8192 columns
# (the remainder last) joined by one Concat compile with no CPU op (convert/README.md,
# "Toolkit build cost at real width"; uneven pieces moved the Concat to the CPU).
LM_HEAD_PIECE = 8192


@dataclass(frozen=True)
class StageGraph:
    name: str
    model: onnx.ModelProto
    inputs: tuple[str, ...]
    input_widths: tuple[int, ...]
    outputs: tuple[str, ...]

    def shape_sets(self, chunk_sizes: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Decode (T=1) first, then each prefill chunk: rknn-toolkit2's dynamic_input."""
        sizes = (1, *[c for c in chunk_sizes if c != 1])
        return tuple(tuple((1, t, w) for w in self.input_widths) for t in sizes)


def _inputs(b: GraphBuilder, contract: StageContract) -> list[str]:
    return [b.input(t.name, [1, T, t.width]) for t in contract.inputs]


def _finish(b: GraphBuilder, name: str, contract: StageContract, outputs: Sequence[str]
            ) -> StageGraph:
    """Name ``outputs`` (values, in contract order) as the contract declares them."""
    for t, value in zip(contract.outputs, outputs, strict=True):
        b.output(value, t.name)
    return StageGraph(name, b.build(), contract.input_names,
                      tuple(t.width for t in contract.inputs), contract.output_names)


def _rows(w: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(w[start:stop])


# --------------------------------------------------------------------------- input stages
def kda_input_graph(name: str, w: KdaInputWeights, cfg: ModelConfig,
                    weight_dtype: type = np.float32, external: Path | None = None
                ) -> StageGraph:
    h, d = cfg.num_attention_heads, cfg.kda_head_dim
    p = h * d
    contract = kda_input_contract(cfg)
    b = GraphBuilder(name, weight_dtype, external)
    (x,) = _inputs(b, contract)
    u = b.rmsnorm(x, w.norm, cfg.rms_norm_eps, "norm")
    qkv = b.linear(u, _rows(w.proj, 0, 3 * p), "qkv")
    f = b.linear(u, _rows(w.proj, 3 * p, 4 * p), "f")
    g = b.linear(u, _rows(w.proj, 4 * p, 5 * p), "g")
    beta = b.sigmoid(b.linear(u, _rows(w.proj, 5 * p, 5 * p + h), "b"))
    rate = np.repeat(np.exp(w.a_log.astype(np.float64)), d).astype(np.float32)  # per channel
    if cfg.kda_safe_gate:
        # The forget logit z = A (f + dt_bias) (one folded scale + shift), clipped to where
        # the gate still moves; the CPU applies g = lb * sigmoid(z)
        # (stages.safe_gate_log_decay and FORGET_LOGIT_RANGE say why).
        z = b.scale_shift(f, "forget", scale=rate, shift=rate * w.dt_bias)
        lo, hi = (b.constant(f"forget.{k}", np.array(v, np.float32))
                  for k, v in zip(("min", "max"), FORGET_LOGIT_RANGE, strict=True))
        decay = b.node("Clip", [z, lo, hi])
    else:
        sp = b.node("Softplus", [b.scale_shift(f, "forget", shift=w.dt_bias)])
        decay = b.scale_shift(sp, "neg_rate", scale=-rate)
    return _finish(b, name, contract, (qkv, decay, beta, g))


def mla_input_graph(name: str, w: MlaInputWeights, cfg: ModelConfig,
                    weight_dtype: type = np.float32, external: Path | None = None
                ) -> StageGraph:
    h, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    r, dqk = cfg.kv_lora_rank, cfg.qk_head_dim
    contract = mla_input_contract(cfg)
    b = GraphBuilder(name, weight_dtype, external)
    (x,) = _inputs(b, contract)
    u = b.rmsnorm(x, w.norm, cfg.rms_norm_eps, "norm")
    q_width = w.proj.shape[0] - r - dr - h
    if w.q_b is not None:
        assert w.q_a_norm is not None  # q_lora's norm and up-projection come together
        q_in = b.rmsnorm(b.linear(u, _rows(w.proj, 0, q_width), "q_a"), w.q_a_norm,
                         LATENT_NORM_EPS, "q_a_norm")
        q_w = w.q_b
    else:
        q_in, q_w = u, _rows(w.proj, 0, q_width)
    # Split the query rows per head into their nope and rope parts in the weight, not with
    # a Slice of the activations: two plain projections.
    per_head = q_w.reshape(h, dqk, q_w.shape[-1])
    q_nope = b.linear(q_in, per_head[:, :dn].reshape(h * dn, -1), "q_nope")
    q_rope = b.linear(q_in, per_head[:, dn:].reshape(h * dr, -1), "q_rope")
    # Absorbed query: per head W_kb_h^T q_nope_h, one batched MatMul over the heads.
    heads = b.node("Transpose", [b.reshape(q_nope, [0, 0, h, dn], "q_nope.shape")],
                   perm=[0, 2, 1, 3])  # [1, H, T, dn]
    absorbed = b.node("MatMul", [heads, b.weight("w_kb", w.w_kb)])  # [1, H, T, r]
    q_latent = b.reshape(b.node("Transpose", [absorbed], perm=[0, 2, 1, 3]), [0, 0, h * r],
                         "q_latent.shape")
    latent = b.rmsnorm(b.linear(u, _rows(w.proj, q_width, q_width + r), "kv_a"),
                       w.kv_a_norm, LATENT_NORM_EPS, "kv_a_norm")
    k_rope = b.linear(u, _rows(w.proj, q_width + r, q_width + r + dr), "k_rope")
    gate = b.sigmoid(b.linear(u, _rows(w.proj, q_width + r + dr, q_width + r + dr + h), "gate"))
    return _finish(b, name, contract, (q_latent, q_rope, latent, k_rope, gate))


# --------------------------------------------------------------------------- output stages
def kda_output_graph(name: str, w: OutputWeights, cfg: ModelConfig,
                     weight_dtype: type = np.float32, external: Path | None = None
                ) -> StageGraph:
    """``core_normed`` is ``stages.kda_core_norm(core)``, done on the CPU (why: there); the
    graph applies o_norm's weight and the sigmoid gate, channel-wise over all heads."""
    h = cfg.num_attention_heads
    contract = output_contract(cfg, "kda", _ffn_kind(w))
    b = GraphBuilder(name, weight_dtype, external)
    x, core, gate = _inputs(b, contract)
    y = b.mul(core, b.sigmoid(gate))
    # o_norm's weight folded into o_proj's columns: (c * w) @ P.T == c @ (P * w).T
    folded = replace(w, o_proj=w.o_proj * np.tile(np.asarray(w.o_norm, np.float32), h)[None])
    return _output_tail(b, name, contract, x, y, folded, cfg)


def mla_output_graph(name: str, w: OutputWeights, cfg: ModelConfig,
                     weight_dtype: type = np.float32, external: Path | None = None
                ) -> StageGraph:
    h, r, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.v_head_dim
    contract = output_contract(cfg, "mla", _ffn_kind(w))
    b = GraphBuilder(name, weight_dtype, external)
    x, ctx_in, gate = _inputs(b, contract)
    ctx = b.reshape(ctx_in, [0, 0, h, r], "ctx.shape")
    heads = b.node("Transpose", [ctx], perm=[0, 2, 1, 3])  # [1, H, T, r]
    assert w.w_vb is not None  # an MLA layer's output weights always carry it
    w_vb_t = np.ascontiguousarray(w.w_vb.transpose(0, 2, 1))  # [H, r, dv]
    values = b.node("Transpose", [b.node("MatMul", [heads, b.weight("w_vb", w_vb_t)])],
                    perm=[0, 2, 1, 3])  # [1, T, H, dv]
    # Each head's gate repeated over its dv channels by a 0/1 projection: a [1, T, H] ->
    # [1, T, H, 1] Reshape is left on the board CPU by the compiler (simulator tier, real
    # widths), a MatMul is not; exact in every precision (one 1 per column).
    spread = b.linear(gate, np.repeat(np.eye(h, dtype=np.float32), dv, axis=0), "gate_spread")
    y = b.mul(b.reshape(values, [0, 0, h * dv], "y.shape"), spread)
    return _output_tail(b, name, contract, x, y, w, cfg)


def _ffn_kind(w: OutputWeights) -> FfnKind:
    if isinstance(w.ffn, DenseFfnWeights):
        return "dense"
    return "moe" if w.ffn.shared_gate_up is None else "moe_shared"


def _output_tail(b: GraphBuilder, name: str, contract: StageContract, x: str, y: str,
                 w: OutputWeights, cfg: ModelConfig) -> StageGraph:
    delta = b.linear(y, w.o_proj, "o_proj")
    u = b.rmsnorm(b.add(x, delta), w.post_norm, cfg.rms_norm_eps, "post_norm")
    if isinstance(w.ffn, DenseFfnWeights):
        inter = w.ffn.gate_up.shape[0] // 2
        ffn = b.swiglu_mlp(u, w.ffn.gate_up[:inter], w.ffn.gate_up[inter:], w.ffn.down, "mlp")
        return _finish(b, name, contract, (delta, ffn))
    outputs = [delta, u]
    gate_up, down = w.ffn.shared_gate_up, w.ffn.shared_down
    if gate_up is not None and down is not None:
        inter = gate_up.shape[0] // 2
        outputs += [b.swiglu_mlp(u, gate_up[:inter], gate_up[inter:], down, "shared")]
    # The router stays float32 in transformers; w8a8 builds quantize it like the rest, the
    # simulator tier measures what that costs.
    outputs.append(b.linear(u, w.ffn.router, "router"))
    return _finish(b, name, contract, outputs)


# --------------------------------------------------------------------------- the rest
def final_graph(name: str, w: FinalWeights, cfg: ModelConfig,
                weight_dtype: type = np.float32, external: Path | None = None,
                piece: int = LM_HEAD_PIECE) -> StageGraph:
    """Final norm + lm_head, the head cut into ``piece``-column MatMuls joined by one
    Concat when the vocabulary is wider (``LM_HEAD_PIECE`` says why)."""
    contract = final_contract(cfg)
    b = GraphBuilder(name, weight_dtype, external)
    (x,) = _inputs(b, contract)
    u = b.rmsnorm(x, w.norm, cfg.rms_norm_eps, "norm")
    vocab = w.lm_head.shape[0]
    if vocab <= piece:
        logits = b.linear(u, w.lm_head, "lm_head")
    else:
        parts = [b.linear(u, w.lm_head[start:start + piece], f"lm_head.{n}")
                 for n, start in enumerate(range(0, vocab, piece))]
        logits = b.node("Concat", parts, "lm_head_concat", axis=-1)
    return _finish(b, name, contract, (logits,))


def expert_graph(name: str, gate_up: np.ndarray, down: np.ndarray, cfg: ModelConfig,
                 weight_dtype: type = np.float32, external: Path | None = None
                ) -> StageGraph:
    """One routed expert for the NPU (``--npu-budget``): ``y = swiglu(x)``."""
    contract = expert_contract(cfg)
    b = GraphBuilder(name, weight_dtype, external)
    (x,) = _inputs(b, contract)
    inter = gate_up.shape[0] // 2
    y = b.swiglu_mlp(x, gate_up[:inter], gate_up[inter:], down, "expert")
    return _finish(b, name, contract, (y,))


def stage_names(cfg: ModelConfig) -> list[str]:
    """Every dense stage in execution order (the NPU calls of one token)."""
    names = []
    for i in range(cfg.num_hidden_layers):
        names += [str(StageName.layer_in(i)), str(StageName.layer_out(i))]
    return [*names, str(StageName.final())]

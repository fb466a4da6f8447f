"""NPU-shaped stages as pure numpy functions with explicit weights.

These are the numpy references the converter's ONNX graphs are tested against, and the
implementation the host runs when no NPU executor is plugged in. Per layer there is an
*input stage* (input RMSNorm + every projection that reads the normalised input) and an
*output stage* (attention output projection + residual + post-attention RMSNorm + either the
dense FFN, or the shared expert and router logits of an MoE layer); plus the final stage
(final norm + lm_head). Projections that read the same input are fused into one matrix so
that a decode step is one matrix-vector product per stage.

Each stage computes the raw outputs of its graph (``stage_contract.py`` declares them)
and hands them to the contract's CPU half, exactly as the bundle stages do with a graph's
outputs. Everything is float32 and works on a [T, ...] batch of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .activations import rms_norm, sigmoid, silu, swiglu
from .stage_contract import (
    LATENT_NORM_EPS,
    KdaInputs,
    LayerOutput,
    MlaInputs,
    finish_kda_input,
    finish_mla_input,
    finish_output,
    kda_core_norm,
    safe_gate_log_decay,
)


# --------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class KdaInputWeights:
    norm: np.ndarray  # [D] input_layernorm
    proj: np.ndarray  # [3P + P + P + H, D]: q, k, v, f (forget), g (output gate), b (beta)
    dt_bias: np.ndarray  # [P]
    a_log: np.ndarray  # [H]


@dataclass(frozen=True)
class MlaInputWeights:
    norm: np.ndarray  # [D] input_layernorm
    # q_lora: [r_q + r_kv + d_r + H, D] = q_a, kv_a_proj_with_mqa, gate;
    # plain q: [H * d_qk + r_kv + d_r + H, D] = q_proj, kv_a_proj_with_mqa, gate.
    proj: np.ndarray
    q_a_norm: np.ndarray | None  # [r_q] (q_lora only)
    q_b: np.ndarray | None  # [H * d_qk, r_q] (q_lora only)
    kv_a_norm: np.ndarray  # [r_kv]
    w_kb: np.ndarray  # [H, d_n, r_kv]: key half of kv_b_proj, absorbed into the query


@dataclass(frozen=True)
class DenseFfnWeights:
    gate_up: np.ndarray  # [2I, D]
    down: np.ndarray  # [D, I]


@dataclass(frozen=True)
class MoeStageWeights:
    shared_gate_up: np.ndarray | None  # [2 I_s, D] (None without shared experts)
    shared_down: np.ndarray | None  # [D, I_s]
    router: np.ndarray  # [E, D], float32 as in transformers


@dataclass(frozen=True)
class OutputWeights:
    o_norm: np.ndarray | None  # [d] KDA gated head-wise RMSNorm; None for MLA
    o_proj: np.ndarray  # [D, P] (KDA) or [D, H * d_v] (MLA)
    w_vb: np.ndarray | None  # [H, d_v, r_kv]: value half of kv_b_proj (MLA only)
    post_norm: np.ndarray  # [D]
    ffn: DenseFfnWeights | MoeStageWeights


@dataclass(frozen=True)
class FinalWeights:
    norm: np.ndarray  # [D]
    lm_head: np.ndarray  # [V, D]


# --------------------------------------------------------------------------- stages
def kda_input_stage(
    x: np.ndarray,
    w: KdaInputWeights,
    *,
    num_heads: int,
    head_dim: int,
    eps: float,
    safe_gate: bool,
    lower_bound: float,
) -> KdaInputs:
    t = x.shape[0]
    p = num_heads * head_dim
    y = rms_norm(x, w.norm, eps) @ w.proj.T
    f = y[:, 3 * p : 4 * p].reshape(t, num_heads, head_dim) + w.dt_bias.reshape(num_heads, head_dim)
    rate = np.exp(w.a_log)[None, :, None]
    # safe gate: the forget logit A f (the CPU half applies lb * sigmoid); otherwise the
    # log decay -A * softplus(f) itself.
    decay = rate * f if safe_gate else -rate * np.logaddexp(0.0, f)
    outputs = (y[:, : 3 * p], decay, sigmoid(y[:, 5 * p :]), y[:, 4 * p : 5 * p])
    return finish_kda_input(outputs, num_heads=num_heads, head_dim=head_dim,
                            safe_gate=safe_gate, lower_bound=lower_bound)


def mla_input_stage(
    x: np.ndarray,
    w: MlaInputWeights,
    *,
    num_heads: int,
    qk_head_dim: int,
    kv_lora_rank: int,
    rope_dim: int,
    eps: float,
) -> MlaInputs:
    t = x.shape[0]
    y = rms_norm(x, w.norm, eps) @ w.proj.T
    q_width = y.shape[1] - kv_lora_rank - rope_dim - num_heads
    q = y[:, :q_width]
    if w.q_b is not None:
        assert w.q_a_norm is not None  # q_lora's norm and up-projection come together
        q = rms_norm(q, w.q_a_norm, LATENT_NORM_EPS) @ w.q_b.T
    kv = y[:, q_width : q_width + kv_lora_rank + rope_dim]
    q = q.reshape(t, num_heads, qk_head_dim)
    nope = w.w_kb.shape[1]
    # Absorbed MLA: pull the query into latent space here (a dense product, NPU work) so the
    # CPU attends over the cached latent without expanding keys or values.
    q_latent = np.matmul(q[:, :, :nope].transpose(1, 0, 2), w.w_kb).transpose(1, 0, 2)
    latent = rms_norm(kv[:, :kv_lora_rank], w.kv_a_norm, LATENT_NORM_EPS)
    outputs = (q_latent, q[:, :, nope:], latent, kv[:, kv_lora_rank:], sigmoid(y[:, -num_heads:]))
    return finish_mla_input(outputs, num_heads=num_heads)


def kda_output_stage(
    x: np.ndarray, core: np.ndarray, out_gate: np.ndarray, w: OutputWeights, *, eps: float
) -> LayerOutput:
    """``core`` [T, H, d] is the recurrence output; gated head-wise RMSNorm, then o_proj."""
    return kda_normed_output_stage(x, kda_core_norm(core, eps), out_gate, w, eps=eps)


def kda_normed_output_stage(
    x: np.ndarray, core_normed: np.ndarray, out_gate: np.ndarray, w: OutputWeights, *,
    eps: float
) -> LayerOutput:
    """The KDA output stage as the NPU graph runs it: ``core_normed`` is
    ``kda_core_norm(core)``, computed on the CPU."""
    y = core_normed * w.o_norm * sigmoid(out_gate)
    return _output_tail(x, y.reshape(x.shape[0], -1), w, eps)


def mla_output_stage(
    x: np.ndarray, ctx: np.ndarray, gate: np.ndarray, w: OutputWeights, *, eps: float
) -> LayerOutput:
    """``ctx`` [T, H, r_kv] is the attention-weighted latent, ``gate`` [T, H] the sigmoid head
    gate; values are W_vb_h ctx_h (the absorbed value up-projection)."""
    assert w.w_vb is not None  # an MLA layer's output weights always carry it
    attn = np.matmul(ctx.transpose(1, 0, 2), w.w_vb.transpose(0, 2, 1)).transpose(1, 0, 2)
    y = (attn * gate[:, :, None]).reshape(x.shape[0], -1)
    return _output_tail(x, y, w, eps)


def _output_tail(x: np.ndarray, y: np.ndarray, w: OutputWeights, eps: float) -> LayerOutput:
    """The output stage's contract outputs, finished by the CPU half (residual adds)."""
    attn_delta = y @ w.o_proj.T
    u = rms_norm(x + attn_delta, w.post_norm, eps)
    if isinstance(w.ffn, DenseFfnWeights):
        return finish_output(x, (attn_delta, swiglu(u, w.ffn.gate_up, w.ffn.down)))
    gate_up, down = w.ffn.shared_gate_up, w.ffn.shared_down
    shared = () if gate_up is None or down is None else (swiglu(u, gate_up, down),)
    return finish_output(x, (attn_delta, u, *shared, u @ w.ffn.router.T))


__all__ = [
    "DenseFfnWeights",
    "FinalWeights",
    "KdaInputWeights",
    "KdaInputs",
    "LayerOutput",
    "MlaInputWeights",
    "MlaInputs",
    "MoeStageWeights",
    "OutputWeights",
    "final_stage",
    "kda_core_norm",
    "kda_input_stage",
    "kda_normed_output_stage",
    "kda_output_stage",
    "mla_input_stage",
    "mla_output_stage",
    "rms_norm",
    "safe_gate_log_decay",
    "sigmoid",
    "silu",
    "swiglu",
]


def final_stage(x: np.ndarray, w: FinalWeights, *, eps: float) -> np.ndarray:
    return rms_norm(x, w.norm, eps) @ w.lm_head.T

"""NPU-shaped stages as pure numpy functions with explicit weights.

These are the numpy references the converter's ONNX graphs are tested against, and the
implementation the host runs when no NPU executor is plugged in. Per layer there is an
*input stage* (input RMSNorm + every projection that reads the normalised input) and an
*output stage* (attention output projection + residual + post-attention RMSNorm + either the
dense FFN, or the shared expert and router logits of an MoE layer); plus the final stage
(final norm + lm_head). Projections that read the same input are fused into one matrix so
that a decode step is one matrix-vector product per stage.

Everything is float32 and works on a [T, ...] batch of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis (transformers' RMSNorm)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88 (float32), which still gives the right 0; only the
    # warning is silenced. Measured ~1.5x faster here than the tanh form and the two-branch form.
    with np.errstate(over="ignore"):
        y = np.exp(-x)
    y += np.float32(1.0)
    return np.reciprocal(y, out=y)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down @ (silu(gate @ x) * (up @ x)); ``gate_up`` stacks gate rows then up rows."""
    h = x @ gate_up.T
    inter = gate_up.shape[0] // 2
    return (silu(h[..., :inter]) * h[..., inter:]) @ down.T


def safe_gate_log_decay(forget_logit: np.ndarray, lower_bound: float) -> np.ndarray:
    """KDA safe gate g = lb * sigmoid(z), z = exp(A_log) * (f + dt_bias): in (lb, 0).

    Its own function because the NPU stage outputs z and the CPU applies this: as a w8a8
    output, g itself would sit on a ~0.02 grid over (-5, 0), rounding the slow decays
    (g near 0, long memory) that compound over every position.
    """
    return lower_bound * sigmoid(forget_logit)


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


# --------------------------------------------------------------------------- outputs
@dataclass(frozen=True)
class KdaInputs:
    qkv: np.ndarray  # [T, 3P] pre-conv q | k | v
    log_decay: np.ndarray  # [T, H, d] g_t in (lower_bound, 0)
    beta: np.ndarray  # [T, H]
    out_gate: np.ndarray  # [T, H, d] pre-sigmoid gate of the o_norm


@dataclass(frozen=True)
class MlaInputs:
    q_latent: np.ndarray  # [T, H, r_kv] = W_kb_h^T q_nope_h (absorbed query)
    q_rope: np.ndarray  # [T, H, d_r] not yet rotated
    latent: np.ndarray  # [T, r_kv] normalised c_kv
    k_rope: np.ndarray  # [T, d_r] not yet rotated
    gate: np.ndarray  # [T, H] sigmoid head gate


@dataclass(frozen=True)
class LayerOutput:
    """``hidden`` is the residual stream after the attention block, or after the whole layer
    for a dense-FFN layer. For an MoE layer the CPU adds the routed experts:
    x = hidden + shared + experts(moe_input, top-k of router_logits)."""

    hidden: np.ndarray  # [T, D]
    moe_input: np.ndarray | None = None  # [T, D] post-attention RMSNorm output
    shared: np.ndarray | None = None  # [T, D] shared-expert output
    router_logits: np.ndarray | None = None  # [T, E]


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
    # safe gate: lb * sigmoid(A f) in (lb, 0); otherwise -A * softplus(f).
    log_decay = (
        safe_gate_log_decay(rate * f, lower_bound) if safe_gate else -rate * np.logaddexp(0.0, f)
    )
    return KdaInputs(
        qkv=y[:, : 3 * p],
        log_decay=log_decay.astype(np.float32, copy=False),
        beta=sigmoid(y[:, 5 * p :]),
        out_gate=y[:, 4 * p : 5 * p].reshape(t, num_heads, head_dim),
    )


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
        # The latent norms use transformers' class default eps (1e-6), not the config value.
        q = rms_norm(q, w.q_a_norm, 1e-6) @ w.q_b.T
    kv = y[:, q_width : q_width + kv_lora_rank + rope_dim]
    q = q.reshape(t, num_heads, qk_head_dim)
    nope = w.w_kb.shape[1]
    # Absorbed MLA: pull the query into latent space here (a dense product, NPU work) so the
    # CPU attends over the cached latent without expanding keys or values.
    q_latent = np.matmul(q[:, :, :nope].transpose(1, 0, 2), w.w_kb).transpose(1, 0, 2)
    return MlaInputs(
        q_latent=q_latent,
        q_rope=q[:, :, nope:],
        latent=rms_norm(kv[:, :kv_lora_rank], w.kv_a_norm, 1e-6),
        k_rope=kv[:, kv_lora_rank:],
        gate=sigmoid(y[:, -num_heads:]),
    )


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


def kda_core_norm(core: np.ndarray, eps: float) -> np.ndarray:
    """The scale-free half of KDA's head-wise o_norm, done on the CPU before the output
    stage: a w8a8 graph quantizes its ``core`` input per tensor, and a prompt's first
    token has ~5x less recurrence output than the rest, so it kept only a few int8
    levels (convert/README.md, "w8a8 on the tiny checkpoint"). Normalised heads share one
    range; the graph applies the weight and the gate."""
    var = np.mean(np.square(core), axis=-1, keepdims=True)
    return core / np.sqrt(var + eps)


def mla_output_stage(
    x: np.ndarray, ctx: np.ndarray, gate: np.ndarray, w: OutputWeights, *, eps: float
) -> LayerOutput:
    """``ctx`` [T, H, r_kv] is the attention-weighted latent, ``gate`` [T, H] the sigmoid head
    gate; values are W_vb_h ctx_h (the absorbed value up-projection)."""
    attn = np.matmul(ctx.transpose(1, 0, 2), w.w_vb.transpose(0, 2, 1)).transpose(1, 0, 2)
    y = (attn * gate[:, :, None]).reshape(x.shape[0], -1)
    return _output_tail(x, y, w, eps)


def _output_tail(x: np.ndarray, y: np.ndarray, w: OutputWeights, eps: float) -> LayerOutput:
    hidden = x + y @ w.o_proj.T
    u = rms_norm(hidden, w.post_norm, eps)
    if isinstance(w.ffn, DenseFfnWeights):
        return LayerOutput(hidden=hidden + swiglu(u, w.ffn.gate_up, w.ffn.down))
    shared = (
        swiglu(u, w.ffn.shared_gate_up, w.ffn.shared_down)
        if w.ffn.shared_gate_up is not None
        else np.zeros_like(u)
    )
    return LayerOutput(hidden=hidden, moe_input=u, shared=shared, router_logits=u @ w.ffn.router.T)


def final_stage(x: np.ndarray, w: FinalWeights, *, eps: float) -> np.ndarray:
    return rms_norm(x, w.norm, eps) @ w.lm_head.T

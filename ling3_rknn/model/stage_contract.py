"""The stage contract, declared once: every NPU stage's inputs and outputs and the CPU work
around it.

A stage graph takes and returns float32 ``[1, T, width]`` tensors, in the order declared
here. Three users keep to it:

* the numpy stages (``model/stages.py``) compute the same raw outputs and finish them
  with the functions below;
* the ONNX builders (``convert/stage_graphs.py``) name their inputs and outputs from
  :func:`stage_contract`;
* the bundle stages (``model/bundle_stages.py``) check each graph's declared names
  against the contract once, at load, and then read outputs by position.

What the CPU does around the graphs (docs/model.md 7):

* before a KDA output stage: the scale-free half of o_norm (``stages.kda_core_norm``);
* after a KDA input stage: the safe gate ``g = lb * sigmoid(forget_logit)``
  (``stages.safe_gate_log_decay`` says why it is not an NPU output);
* after every output stage: the residual adds, in float32 (``x + attn_delta`` and, for
  a dense-FFN layer, ``+ ffn_delta``). w8a8 quantizes activations per tensor, and the
  residual stream's outlier channels lose precision when the sum itself is an NPU output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from ..bundle import StageName
from ..config import ModelConfig
from .activations import sigmoid

STAGE_DTYPE = "float32"  # every stage input and output
# The q_a / kv_a latent norms use transformers' class default eps, not the config value.
LATENT_NORM_EPS = 1e-6
# The safe-gate forget logit z = A (f + dt_bias) as a w8a8 output. Unclipped it spans
# ~(-150, 18) on the tiny checkpoint (A and dt_bias differ per head): a 0.66 int8 step,
# i.e. +-33 % error on every slow decay g = lb sigmoid(z) ~ lb e^z. The gate only moves
# inside this range: at -16, |g| = 5.6e-7 per token (a decay of 0.98 after 32K tokens,
# against 1.0), at 6, g is 99.75 % of lb. Clipped, the step is 0.086 (+-4.3 %). The graphs
# clip; the numpy reference does not need to.
FORGET_LOGIT_RANGE = (-16.0, 6.0)


# --------------------------------------------------------------------------- what the CPU gets
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


def safe_gate_log_decay(forget_logit: np.ndarray, lower_bound: float) -> np.ndarray:
    """KDA safe gate g = lb * sigmoid(z), z = exp(A_log) * (f + dt_bias): in (lb, 0).

    Its own function because the NPU stage outputs z and the CPU applies this: as a w8a8
    output, g itself would sit on a ~0.02 grid over (-5, 0), rounding the slow decays
    (g near 0, long memory) that compound over every position.
    """
    return lower_bound * sigmoid(forget_logit)


def kda_core_norm(core: np.ndarray, eps: float) -> np.ndarray:
    """The scale-free half of KDA's head-wise o_norm, done on the CPU before the output
    stage: a w8a8 graph quantizes its ``core`` input per tensor, and a prompt's first
    token has ~5x less recurrence output than the rest, so it kept only a few int8
    levels (convert/README.md, "w8a8 on the tiny checkpoint"). Normalised heads share one
    range; the graph applies the weight and the gate."""
    var = np.mean(np.square(core), axis=-1, keepdims=True)
    return core / np.sqrt(var + eps)


# --------------------------------------------------------------------------- graph signatures
class Tensor(NamedTuple):
    """One stage input or output: ``[1, T, width]`` float32."""

    name: str
    width: int


@dataclass(frozen=True)
class StageContract:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


def kda_input_contract(cfg: ModelConfig) -> StageContract:
    """``x`` -> ``qkv`` (pre-conv), the forget logit (safe gate) or ``log_decay``,
    ``beta``, ``out_gate``."""
    h, p = cfg.num_attention_heads, cfg.num_attention_heads * cfg.kda_head_dim
    decay = "forget_logit" if cfg.kda_safe_gate else "log_decay"
    return StageContract((Tensor("x", cfg.hidden_size),),
                         (Tensor("qkv", 3 * p), Tensor(decay, p), Tensor("beta", h),
                          Tensor("out_gate", p)))


def mla_input_contract(cfg: ModelConfig) -> StageContract:
    """``x`` -> the absorbed query ``q_latent``, ``q_rope``, normalised ``latent``,
    ``k_rope`` (both rope parts not yet rotated) and the sigmoid head ``gate``."""
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return StageContract((Tensor("x", cfg.hidden_size),),
                         (Tensor("q_latent", h * r), Tensor("q_rope", h * dr),
                          Tensor("latent", r), Tensor("k_rope", dr), Tensor("gate", h)))


FfnKind = Literal["dense", "moe", "moe_shared"]  # the FFN half of an output stage


def ffn_kind(cfg: ModelConfig, layer: int) -> FfnKind:
    if not cfg.is_moe_layer(layer):
        return "dense"
    return "moe_shared" if cfg.shared_intermediate_size else "moe"


def output_contract(cfg: ModelConfig, attention: str, ffn: FfnKind) -> StageContract:
    """KDA ``x, core_normed, out_gate`` / MLA ``x, ctx, gate`` -> ``attn_delta`` plus
    ``ffn_delta`` (dense-FFN layer) or ``moe_input``, ``shared`` (with shared experts)
    and ``router_logits`` (MoE layer)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if attention == "kda":
        p = h * cfg.kda_head_dim
        inputs = (Tensor("x", d), Tensor("core_normed", p), Tensor("out_gate", p))
    else:
        inputs = (Tensor("x", d), Tensor("ctx", h * cfg.kv_lora_rank), Tensor("gate", h))
    if ffn == "dense":
        return StageContract(inputs, (Tensor("attn_delta", d), Tensor("ffn_delta", d)))
    shared = (Tensor("shared", d),) if ffn == "moe_shared" else ()
    return StageContract(inputs, (Tensor("attn_delta", d), Tensor("moe_input", d), *shared,
                                  Tensor("router_logits", cfg.num_experts)))


def final_contract(cfg: ModelConfig) -> StageContract:
    """``x`` -> ``logits`` (final norm + lm_head)."""
    return StageContract((Tensor("x", cfg.hidden_size),), (Tensor("logits", cfg.vocab_size),))


def expert_contract(cfg: ModelConfig) -> StageContract:
    """``x`` -> ``y``: one routed expert the placement plan promoted to the NPU."""
    return StageContract((Tensor("x", cfg.hidden_size),), (Tensor("y", cfg.hidden_size),))


def stage_contract(cfg: ModelConfig, name: StageName) -> StageContract:
    if name.role == "final":
        return final_contract(cfg)
    if name.role == "expert":
        return expert_contract(cfg)
    assert name.layer is not None
    if name.role == "out":
        return output_contract(cfg, cfg.layer_kinds[name.layer], ffn_kind(cfg, name.layer))
    kda = cfg.layer_kinds[name.layer] == "kda"
    return kda_input_contract(cfg) if kda else mla_input_contract(cfg)


# --------------------------------------------------------------------------- the CPU half
def finish_kda_input(outputs: Sequence[np.ndarray], *, num_heads: int, head_dim: int,
                     safe_gate: bool, lower_bound: float) -> KdaInputs:
    """The KDA input stage's outputs ``[T, width]`` (contract order) -> ``KdaInputs``."""
    qkv, decay, beta, out_gate = outputs
    shape = (qkv.shape[0], num_heads, head_dim)
    if safe_gate:
        decay = safe_gate_log_decay(decay, lower_bound)
    return KdaInputs(qkv=qkv, log_decay=decay.reshape(shape).astype(np.float32, copy=False),
                     beta=beta, out_gate=out_gate.reshape(shape))


def finish_mla_input(outputs: Sequence[np.ndarray], *, num_heads: int) -> MlaInputs:
    """The MLA input stage's outputs ``[T, width]`` (contract order) -> ``MlaInputs``."""
    q_latent, q_rope, latent, k_rope, gate = outputs
    t = q_latent.shape[0]
    return MlaInputs(q_latent=q_latent.reshape(t, num_heads, -1),
                     q_rope=q_rope.reshape(t, num_heads, -1),
                     latent=latent, k_rope=k_rope, gate=gate)


def finish_output(x: np.ndarray, outputs: Sequence[np.ndarray]) -> LayerOutput:
    """An output stage's outputs (contract order) -> ``LayerOutput``: the residual adds
    in float32. Two outputs are a dense-FFN layer; three or four an MoE layer (without or
    with shared experts)."""
    hidden = x + outputs[0]  # attn_delta
    if len(outputs) == 2:
        return LayerOutput(hidden=hidden + outputs[1])  # ffn_delta
    moe_input, router_logits = outputs[1], outputs[-1]
    shared = outputs[2] if len(outputs) == 4 else np.zeros_like(hidden)
    return LayerOutput(hidden=hidden, moe_input=moe_input, shared=shared,
                       router_logits=router_logits)

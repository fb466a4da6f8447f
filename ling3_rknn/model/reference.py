"""The Ling-3.0 forward pass written as plainly as it can be: read this file first.

Everything the fast paths do (fused projections, absorbed and expanded MLA, the chunked and
deferred KDA forms, compiled kernels, NPU stages) is an optimisation of exactly this. Here
there is none of it: one function per layer kind over a whole sequence, the checkpoint's own
tensor names, float64 throughout, no state kept between calls (each starts at position 0).
It is far too slow to serve and exists to be read and to hold the fast paths to:
``tests/test_model_reference.py`` pins it to transformers 5.24.0
(``modeling_bailing_hybrid.py``, through the committed oracle fixtures) and pins
``Model.from_hf`` to it on inputs transformers never saw.

Section numbers are those of docs/model.md, which states the same math in words.

    w = ReferenceWeights(checkpoint_dir)
    logits = forward(w, token_ids)   # float64 [T, vocab]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from .checkpoint import Checkpoint
from .safetensors_file import CheckpointError

# The L2 norm of KDA q and k and the MLA latent norms (q_a, kv_a) use fixed epsilons, not
# the config's rms_norm_eps (docs/model.md 3).
L2_NORM_EPS = 1e-6
LATENT_NORM_EPS = 1e-6


class ReferenceWeights:
    """An HF checkpoint directory read by name, every tensor as float64.

    The names are the released checkpoint's (``Checkpoint`` maps transformers' spellings onto
    them); where a tensor has two spellings that depend on the layer (``o_proj``/``dense``,
    merged or separate convs and experts) ``get`` takes the first name that exists. Every
    tensor read is kept (in float64): meant for the small checkpoints tests run it on.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        root = Path(directory)
        self.config = ModelConfig.from_file(root / "config.json")
        self._checkpoint = Checkpoint.open(root)
        self._read: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return self._checkpoint.has(name)

    def get(self, *names: str) -> np.ndarray:
        for name in names:
            if name in self._read:
                return self._read[name]
            if self._checkpoint.has(name):
                shape = self._checkpoint.shape(name)
                self._read[name] = self._checkpoint.tensor(name, shape).astype(np.float64)
                return self._read[name]
        raise CheckpointError(f"missing tensor {' or '.join(map(repr, names))}")


# --------------------------------------------------------------------------- elementwise
def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x^2) + eps) over the last axis (docs/model.md 3.1)."""
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2_norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6), the epsilon inside the root (docs/model.md 3.3)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def swiglu(u: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down (silu(gate u) * up u): the dense FFN, the shared and the routed experts."""
    return (silu(u @ gate.T) * (u @ up.T)) @ down.T


# --------------------------------------------------------------------------- KDA (4)
def kda_attention(w: ReferenceWeights, i: int, u: np.ndarray) -> np.ndarray:
    """Kimi Delta Attention of layer ``i`` over the normalised input u [T, D] -> [T, D]."""
    c = w.config
    t, h, d = len(u), c.num_attention_heads, c.kda_head_dim
    a = f"model.layers.{i}.attention."

    # 4.1 projections, then a depthwise causal conv (the last tap on the current token,
    # zeros before the sequence) and SiLU over the q | k | v channels
    qkv = np.concatenate([u @ w.get(a + f"{n}_proj.weight").T for n in "qkv"], axis=1)
    if w.has(a + "conv1d.weight"):
        taps = w.get(a + "conv1d.weight")[:, 0, :]  # [3P, K]
    else:
        taps = np.concatenate([w.get(a + f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"])
    k_c = taps.shape[1]
    padded = np.concatenate([np.zeros((k_c - 1, qkv.shape[1])), qkv])
    conv = sum(padded[j : j + t] * taps[:, j] for j in range(k_c))
    q, k, v = (x.reshape(t, h, d) for x in np.split(silu(conv), 3, axis=1))

    # 4.2 per-head L2 norms; the query also takes the 1/sqrt(d) scale
    q = l2_norm(q) / np.sqrt(d)
    k = l2_norm(k)

    # 4.3 per-channel log decay g (safe gate: lb * sigmoid(A (f + dt_bias))), write strength
    f = (u @ w.get(a + "f_proj.weight").T).reshape(t, h, d) + w.get(a + "dt_bias").reshape(h, d)
    rate = np.exp(w.get(a + "A_log"))[:, None]  # [H, 1]
    g = (c.kda_lower_bound * sigmoid(rate * f) if c.kda_safe_gate  # Ling-3.0
         else -rate * np.logaddexp(0.0, f))
    beta = sigmoid(u @ w.get(a + "b_proj.weight").T)  # [T, H]

    # 4.4 the delta rule, token by token; S [H, d_k, d_v] starts at zero
    state = np.zeros((h, d, d))
    out = np.empty((t, h, d))
    for s in range(t):
        state = np.exp(g[s])[:, :, None] * state  # decay each key row
        predicted = np.einsum("hkv,hk->hv", state, k[s])  # S^T k
        delta = beta[s][:, None] * (v[s] - predicted)
        state = state + np.einsum("hk,hv->hkv", k[s], delta)  # S + k (beta (v - S^T k))^T
        out[s] = np.einsum("hkv,hk->hv", state, q[s])  # S^T q on the corrected state

    # 4.7 gated head-wise RMSNorm (one weight vector shared by the heads), output projection
    gate = (u @ w.get(a + "g_proj.weight").T).reshape(t, h, d)
    y = rms_norm(out, w.get(a + "o_norm.weight"), c.rms_norm_eps) * sigmoid(gate)
    return y.reshape(t, h * d) @ w.get(a + "o_proj.weight", a + "dense.weight").T


# --------------------------------------------------------------------------- MLA (5)
def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Interleaved RoPE over x [T, ..., d_r] (docs/model.md 5.3).

    Adjacent pairs (x_2i, x_2i+1) rotate by p * theta^(-2i/d_r). As transformers does, the
    result is written de-interleaved (the rotated evens, then the rotated odds); q and k
    get the same order, so their dot products are those of the interleaved vectors.
    """
    d_r = x.shape[-1]
    freq = theta ** (-np.arange(0, d_r, 2) / d_r)
    angle = positions[:, None] * freq[None, :]  # [T, d_r / 2]
    angle = angle.reshape((len(positions),) + (1,) * (x.ndim - 2) + (d_r // 2,))
    cos, sin = np.cos(angle), np.sin(angle)
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def mla_attention(w: ReferenceWeights, i: int, u: np.ndarray) -> np.ndarray:
    """Multi-head latent attention of layer ``i`` over u [T, D] -> [T, D], with keys and
    values expanded per head from the latent as transformers does (no absorption)."""
    c = w.config
    t, h = len(u), c.num_attention_heads
    d_n, d_r, d_v, r_kv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    a = f"model.layers.{i}.attention."
    positions = np.arange(t, dtype=np.float64)

    # 5.1 query: low rank (q_a, its norm, q_b) or one q_proj; per head [nope | rope]
    if c.q_lora_rank is not None:
        q_a = rms_norm(u @ w.get(a + "q_a_proj.weight").T, w.get(a + "q_a_layernorm.weight"),
                       LATENT_NORM_EPS)
        q = q_a @ w.get(a + "q_b_proj.weight").T
    else:
        q = u @ w.get(a + "q_proj.weight").T
    q = q.reshape(t, h, d_n + d_r)
    q = np.concatenate([q[..., :d_n], rope(q[..., d_n:], positions, c.rope_theta)], axis=-1)

    # 5.2 the latent: normalised c_kv and one rotary key shared by all heads
    kv_a = u @ w.get(a + "kv_a_proj_with_mqa.weight").T
    latent = rms_norm(kv_a[:, :r_kv], w.get(a + "kv_a_layernorm.weight"), LATENT_NORM_EPS)
    k_rope = rope(kv_a[:, r_kv:], positions, c.rope_theta)  # [T, d_r]

    # kv_b expands the latent into per-head [k_nope | v]
    kv = (latent @ w.get(a + "kv_b_proj.weight").T).reshape(t, h, d_n + d_v)
    keys = np.concatenate([kv[..., :d_n], np.broadcast_to(k_rope[:, None], (t, h, d_r))], -1)
    values = kv[..., d_n:]

    # 5.4 causal softmax attention, scale 1/sqrt(d_n + d_r)
    scores = np.einsum("thd,shd->hts", q, keys) / np.sqrt(d_n + d_r)
    scores = np.where(np.tri(t, dtype=bool), scores, -np.inf)  # key s <= query t
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("hts,shd->thd", p, values)  # [T, H, d_v]

    # 5.6 head-wise sigmoid gate, then the output projection
    gate = sigmoid(u @ w.get(a + "g_proj.weight").T)  # [T, H]
    y = (out * gate[:, :, None]).reshape(t, h * d_v)
    return y @ w.get(a + "dense.weight", a + "o_proj.weight").T


# --------------------------------------------------------------------------- FFN (6)
def dense_ffn(w: ReferenceWeights, i: int, u: np.ndarray) -> np.ndarray:
    """The dense SwiGLU of the first ``first_k_dense_replace`` layers (6.4)."""
    m = f"model.layers.{i}.mlp."
    return swiglu(u, w.get(m + "gate_proj.weight"), w.get(m + "up_proj.weight"),
                  w.get(m + "down_proj.weight"))


def route(w: ReferenceWeights, i: int, u_t: np.ndarray) -> tuple[list[int], list[float]]:
    """Group-limited sigmoid routing of one token (6.1-6.2): expert ids and weights."""
    c = w.config
    scores = sigmoid(u_t @ w.get(f"model.layers.{i}.mlp.gate.weight").T)  # [E]
    # the expert bias steers which experts are chosen, never their weights
    choice = scores + w.get(f"model.layers.{i}.mlp.gate.expert_bias")
    groups = choice.reshape(c.n_group, -1)
    group_score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)  # the two best per group
    kept = np.argsort(-group_score, kind="stable")[: c.topk_group]
    masked = np.full_like(groups, -np.inf)
    masked[kept] = groups[kept]
    ids = np.argsort(-masked.ravel(), kind="stable")[: c.num_experts_per_tok]
    weights = scores[ids]
    if c.norm_topk_prob:
        weights = weights / (weights.sum() + 1e-20)
    weights = weights * c.routed_scaling_factor
    return ids.tolist(), weights.tolist()


def expert(w: ReferenceWeights, i: int, e: int, u: np.ndarray) -> np.ndarray:
    """Routed expert ``e`` (6.3): per-expert tensors, or transformers' merged [E, ...] ones
    with the gate rows before the up rows."""
    m = f"model.layers.{i}.mlp.experts."
    if w.has(m + "gate_up_proj"):
        gate_up = w.get(m + "gate_up_proj")[e]
        gate, up = np.split(gate_up, 2)
        return swiglu(u, gate, up, w.get(m + "down_proj")[e])
    x = f"{m}{e}."
    return swiglu(u, w.get(x + "gate_proj.weight"), w.get(x + "up_proj.weight"),
                  w.get(x + "down_proj.weight"))


def moe(w: ReferenceWeights, i: int, u: np.ndarray) -> np.ndarray:
    """Routed experts weighted per token, plus the always-on shared expert (6.3)."""
    out = np.zeros_like(u)
    for t in range(len(u)):
        for e, weight in zip(*route(w, i, u[t]), strict=True):
            out[t] += weight * expert(w, i, e, u[t : t + 1])[0]
    if w.config.shared_intermediate_size:
        s = f"model.layers.{i}.mlp.shared_experts."
        out += swiglu(u, w.get(s + "gate_proj.weight"), w.get(s + "up_proj.weight"),
                      w.get(s + "down_proj.weight"))
    return out


# --------------------------------------------------------------------------- model (2)
def forward(w: ReferenceWeights, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Logits [T, vocab] (float64) of a whole sequence from position 0."""
    c = w.config
    eps = c.rms_norm_eps
    x = w.get("model.word_embeddings.weight")[np.asarray(token_ids)]
    for i, kind in enumerate(c.layer_kinds):
        layer = f"model.layers.{i}."
        u = rms_norm(x, w.get(layer + "input_layernorm.weight"), eps)
        x = x + (kda_attention(w, i, u) if kind == "kda" else mla_attention(w, i, u))
        u = rms_norm(x, w.get(layer + "post_attention_layernorm.weight"), eps)
        x = x + (moe(w, i, u) if c.is_moe_layer(i) else dense_ffn(w, i, u))
    x = rms_norm(x, w.get("model.norm.weight"), eps)
    head = "lm_head.weight"
    if c.tie_word_embeddings and not w.has(head):
        head = "model.word_embeddings.weight"
    return x @ w.get(head).T


def greedy(w: ReferenceWeights, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """The prompt followed by ``new_tokens`` argmax tokens, each from a full forward pass."""
    tokens = [int(t) for t in prompt]
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(forward(w, tokens)[-1])))
    return tokens


__all__ = ["ReferenceWeights", "forward", "greedy"]

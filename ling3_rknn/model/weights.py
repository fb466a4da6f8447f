"""Which checkpoint tensors make up each stage, with their expected shapes.

Resolves the layer-dependent spellings: the KDA output projection is ``attention.o_proj``
in the released checkpoint and ``attention.dense`` when transformers saves it (the MLA one is
``attention.dense``, or ``o_proj`` under module names); the KDA conv is three
``{q,k,v}_conv1d`` tensors or one merged ``conv1d`` [3P, 1, K]; experts are per-expert
tensors or merged ``experts.gate_up_proj`` [E, 2I, D] / ``experts.down_proj`` [E, D, I].
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from .checkpoint import Checkpoint
from .safetensors_file import CheckpointError
from .stages import (
    DenseFfnWeights,
    FinalWeights,
    KdaInputWeights,
    MlaInputWeights,
    MoeStageWeights,
    OutputWeights,
)


class CheckpointWeights:
    """Typed accessors over a ``Checkpoint`` for one ``ModelConfig``."""

    def __init__(self, checkpoint: Checkpoint, config: ModelConfig) -> None:
        self.ckpt = checkpoint
        self.cfg = config
        c = config
        self._p = c.num_attention_heads * c.kda_head_dim

    def _t(self, name: str, *shape: int) -> np.ndarray:
        return self.ckpt.tensor(name, shape)

    def _first(self, names: tuple[str, ...], *shape: int) -> np.ndarray:
        for name in names:
            if self.ckpt.has(name):
                return self._t(name, *shape)
        return self._t(names[0], *shape)  # raises "missing tensor <first name>"

    # ----------------------------------------------------------------- top level
    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        c = self.cfg
        return self.ckpt.rows("model.word_embeddings.weight", (c.vocab_size, c.hidden_size), ids)

    def final(self) -> FinalWeights:
        c = self.cfg
        head = (
            "model.word_embeddings.weight"
            if c.tie_word_embeddings and not self.ckpt.has("lm_head.weight")
            else "lm_head.weight"
        )
        return FinalWeights(
            norm=self._t("model.norm.weight", c.hidden_size),
            lm_head=self._t(head, c.vocab_size, c.hidden_size),
        )

    # ----------------------------------------------------------------- KDA
    def kda_input(self, i: int) -> KdaInputWeights:
        c, p, a = self.cfg, self._p, f"model.layers.{i}.attention."
        d = c.hidden_size
        parts = [self._t(a + f"{n}.weight", p, d) for n in ("q_proj", "k_proj", "v_proj")]
        parts += [self._t(a + "f_proj.weight", p, d), self._t(a + "g_proj.weight", p, d)]
        parts.append(self._t(a + "b_proj.weight", c.num_attention_heads, d))
        return KdaInputWeights(
            norm=self._t(f"model.layers.{i}.input_layernorm.weight", d),
            proj=np.concatenate(parts, axis=0),
            dt_bias=self._t(a + "dt_bias", p),
            a_log=self._t(a + "A_log", c.num_attention_heads),
        )

    def kda_conv(self, i: int) -> np.ndarray:
        """Depthwise kernels [3P, K] for the q | k | v channels."""
        k, p, a = self.cfg.short_conv_kernel_size, self._p, f"model.layers.{i}.attention."
        if self.ckpt.has(a + "conv1d.weight"):
            return self._t(a + "conv1d.weight", 3 * p, 1, k)[:, 0, :].copy()
        parts = [self._t(a + f"{n}_conv1d.weight", p, 1, k)[:, 0, :] for n in "qkv"]
        return np.concatenate(parts, axis=0)

    # ----------------------------------------------------------------- MLA
    def mla_input(self, i: int) -> MlaInputWeights:
        c, a = self.cfg, f"model.layers.{i}.attention."
        d, h = c.hidden_size, c.num_attention_heads
        q_a_norm: np.ndarray | None
        q_b: np.ndarray | None
        if c.q_lora_rank is not None:
            q = self._t(a + "q_a_proj.weight", c.q_lora_rank, d)
            q_a_norm = self._t(a + "q_a_layernorm.weight", c.q_lora_rank)
            q_b = self._t(a + "q_b_proj.weight", h * c.qk_head_dim, c.q_lora_rank)
        else:
            q = self._t(a + "q_proj.weight", h * c.qk_head_dim, d)
            q_a_norm = q_b = None
        kv_a = self._t(a + "kv_a_proj_with_mqa.weight", c.latent_dim, d)
        gate = self._t(a + "g_proj.weight", h, d)
        return MlaInputWeights(
            norm=self._t(f"model.layers.{i}.input_layernorm.weight", d),
            proj=np.concatenate([q, kv_a, gate], axis=0),
            q_a_norm=q_a_norm,
            q_b=q_b,
            kv_a_norm=self._t(a + "kv_a_layernorm.weight", c.kv_lora_rank),
            w_kb=self.mla_absorbed(i)[0],
        )

    def mla_absorbed(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """kv_b_proj split per head: W_kb [H, d_n, r_kv] and W_vb [H, d_v, r_kv]."""
        c = self.cfg
        h, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        w = self._t(f"model.layers.{i}.attention.kv_b_proj.weight", h * (dn + dv), c.kv_lora_rank)
        w = w.reshape(h, dn + dv, c.kv_lora_rank)
        return np.ascontiguousarray(w[:, :dn]), np.ascontiguousarray(w[:, dn:])

    # ----------------------------------------------------------------- output + FFN
    def output(self, i: int) -> OutputWeights:
        c, a = self.cfg, f"model.layers.{i}.attention."
        d = c.hidden_size
        if c.layer_kinds[i] == "kda":
            w_vb = None
            o_norm = self._t(a + "o_norm.weight", c.kda_head_dim)
            o_proj = self._first((a + "o_proj.weight", a + "dense.weight"), d, self._p)
        else:
            o_norm = None
            w_vb = self.mla_absorbed(i)[1]
            width = c.num_attention_heads * c.v_head_dim
            o_proj = self._first((a + "dense.weight", a + "o_proj.weight"), d, width)
        return OutputWeights(
            o_norm=o_norm,
            o_proj=o_proj,
            w_vb=w_vb,
            post_norm=self._t(f"model.layers.{i}.post_attention_layernorm.weight", d),
            ffn=self._moe_stage(i) if c.is_moe_layer(i) else self._dense_ffn(i),
        )

    def _dense_ffn(self, i: int) -> DenseFfnWeights:
        c, m = self.cfg, f"model.layers.{i}.mlp."
        d, n = c.hidden_size, c.intermediate_size
        return DenseFfnWeights(
            gate_up=np.concatenate(
                [self._t(m + "gate_proj.weight", n, d), self._t(m + "up_proj.weight", n, d)]
            ),
            down=self._t(m + "down_proj.weight", d, n),
        )

    def _moe_stage(self, i: int) -> MoeStageWeights:
        c, m = self.cfg, f"model.layers.{i}.mlp."
        d, n = c.hidden_size, c.shared_intermediate_size
        gate_up: np.ndarray | None
        down: np.ndarray | None
        if n:
            s = m + "shared_experts."
            gate_up = np.concatenate(
                [self._t(s + "gate_proj.weight", n, d), self._t(s + "up_proj.weight", n, d)]
            )
            down = self._t(s + "down_proj.weight", d, n)
        else:
            gate_up = down = None
        return MoeStageWeights(
            shared_gate_up=gate_up,
            shared_down=down,
            router=self._t(m + "gate.weight", c.num_experts, d),
        )

    def expert_bias(self, i: int) -> np.ndarray:
        return self._t(f"model.layers.{i}.mlp.gate.expert_bias", self.cfg.num_experts)

    def expert(self, i: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(gate_up [2I, D], down [D, I]) of routed expert ``e``; a view when stored merged."""
        c, m = self.cfg, f"model.layers.{i}.mlp.experts."
        d, n, big_e = c.hidden_size, c.moe_intermediate_size, c.num_experts
        if self.ckpt.has(m + "gate_up_proj"):
            gate_up = self.ckpt.rows(m + "gate_up_proj", (big_e, 2 * n, d), e)
            return gate_up, self.ckpt.rows(m + "down_proj", (big_e, d, n), e)
        x = f"{m}{e}."
        gate_up = np.concatenate(
            [self._t(x + "gate_proj.weight", n, d), self._t(x + "up_proj.weight", n, d)]
        )
        return gate_up, self._t(x + "down_proj.weight", d, n)

    def check_experts(self, i: int) -> None:
        """Fail at load time, not mid-generation, when an expert tensor is missing."""
        m = f"model.layers.{i}.mlp.experts."
        c = self.cfg
        d, n = c.hidden_size, c.moe_intermediate_size
        if self.ckpt.has(m + "gate_up_proj"):
            self.ckpt.locate(m + "gate_up_proj", (c.num_experts, 2 * n, d))
            self.ckpt.locate(m + "down_proj", (c.num_experts, d, n))
            return
        for e in range(c.num_experts):
            x = f"{m}{e}."
            for name, shape in (
                ("gate_proj.weight", (n, d)),
                ("up_proj.weight", (n, d)),
                ("down_proj.weight", (d, n)),
            ):
                self.ckpt.locate(x + name, shape)


__all__ = ["CheckpointError", "CheckpointWeights"]

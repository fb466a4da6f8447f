"""The demo model's architecture: Ling-3.0's structure at a size a 2-core CPU can train.

Every structural feature of the real model is present (docs/demo-model.md): KDA layers with the
safe gate and short convolutions, MLA layers with a q LoRA, a dense first layer, MoE with
expert groups and a shared expert, an untied lm_head, rope_theta 6e6. Choices that differ
from Ling-3.0-tiny and why:

* ``layer_group_size`` 2 (KDA, MLA, KDA, MLA) instead of 4: on the CPU the torch KDA
  fallback costs more than an MLA layer, and two MLA layers give two chances at the
  attention pattern that copies a name;
* 8 heads: every per-head stage output is >= 8 channels wide, the narrowest the RK3588
  compiler keeps on the NPU (convert/README.md);
* hidden 256 and expert width 128: multiples of QMoE's 32-wide quantization blocks;
* ``max_position_embeddings`` 32768: agent clients' prompts (opencode's is ~17K tokens with
  this vocabulary) must fit. The model trains on < 1K tokens; RoPE at theta 6e6 barely
  turns its low frequencies over 32K positions, so the protocol works that deep even if
  the answers get worse.
"""

from __future__ import annotations

from typing import Any

VOCAB_SIZE = 800
MAX_CONTEXT = 32768


def demo_config() -> dict[str, Any]:
    """Keyword arguments for transformers' ``BailingHybridConfig``."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        layer_group_size=2,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        linear_num_heads=8,
        linear_head_dim=32,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_local_experts=16,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        short_conv_kernel_size=4,
        kda_safe_gate=True,
        kda_lower_bound=-5.0,
        rope_theta=6000000.0,
        max_position_embeddings=MAX_CONTEXT,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
        num_mtp_layers=0,
    )

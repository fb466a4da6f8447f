"""ModelConfig: both config.json spellings, the real Ling-3.0-tiny values, and typed errors."""

from __future__ import annotations

import json

import pytest
from conftest import ORACLE_DIR

from ling3_rknn.config import ConfigError, ModelConfig

# Ling-3.0-tiny's released config.json values (docs/model.md 1), in the released spelling.
TINY = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "model_type": "bailing_hybrid",
    "vocab_size": 157184,
    "hidden_size": 1536,
    "num_hidden_layers": 24,
    "layer_group_size": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_kv_heads_for_linear_attn": 0,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5,
    "no_kda_lora": True,
    "use_kda_lora": False,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "qk_head_dim": 192,
    "v_head_dim": 128,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    "rope_interleave": True,
    "rope_theta": 6000000,
    "rope_scaling": None,
    "max_position_embeddings": 131072,
    "gated_attention_proj_granularity_type": "head_wise",
    "intermediate_size": 4608,
    "first_k_dense_replace": 1,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 512,
    "moe_shared_expert_intermediate_size": 512,
    "n_group": 8,
    "topk_group": 4,
    "score_function": "sigmoid",
    "topk_method": "noaux_tc",
    "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "expert_swiglu_limit_list": None,
    "share_expert_swiglu_limit_list": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "eos_token_id": 156895,
    "pad_token_id": 156892,
    "use_qk_norm": True,
    "max_window_layers": 20,
}

# The same model as transformers 5.24's save_pretrained writes it.
TINY_HF_SAVED = {
    **{k: v for k, v in TINY.items() if k not in ("max_position_embeddings", "num_experts")},
    "head_dim": 64,
    "linear_head_dim": 128,
    "linear_num_heads": 16,
    "linear_conv_kernel_dim": 4,
    "model_max_length": 131072,
    "num_experts": 128,
    "num_experts_per_token": 8,
    "num_expert_group": 8,
    "moe_renormalize": True,
    "kda_lower_bound": -5.0,
    "rope_theta": 6000000.0,
    "rope_parameters": {"rope_theta": 6000000.0, "rope_type": "default"},
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
    "mlp_layer_types": ["dense"] + ["sparse"] * 23,
}
for _k in ("num_experts_per_tok", "n_group", "norm_topk_prob"):
    TINY_HF_SAVED.pop(_k)


def test_real_tiny_config_values():
    c = ModelConfig.from_dict(TINY)
    assert c.mla_layers == (3, 7, 11, 15, 19, 23)
    assert len(c.kda_layers) == 18
    assert c.kda_head_dim == 128 and c.kda_proj_dim == 2048
    assert c.kda_lower_bound == -5.0 and isinstance(c.kda_lower_bound, float)
    assert c.latent_dim == 576 and c.qk_head_dim == 192
    assert c.rope_theta == 6e6 and c.max_position_embeddings == 131072
    assert c.num_experts == 128 and c.num_experts_per_tok == 8
    assert (c.n_group, c.topk_group, c.routed_scaling_factor) == (8, 4, 2.5)
    assert c.eos_token_id == 156895 and c.pad_token_id == 156892
    assert not c.is_moe_layer(0) and c.is_moe_layer(1)


def test_transformers_saved_spelling_is_the_same_model():
    assert ModelConfig.from_dict(TINY_HF_SAVED) == ModelConfig.from_dict(TINY)


def test_round_trip_through_to_dict():
    c = ModelConfig.from_dict(TINY)
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("name", ["lora_hfsave", "plainq_released", "lora_hfmodule_bf16"])
def test_fixture_configs_load(name):
    c = ModelConfig.from_file(ORACLE_DIR / name / "config.json")
    assert c.kda_head_dim == 12  # never the rope head dim transformers writes as head_dim
    assert c.kda_lower_bound == -5.0


def test_integer_lower_bound_in_fixture():
    raw = json.loads((ORACLE_DIR / "lora_hfsave" / "config.json").read_text())
    assert raw["kda_lower_bound"] == -5 and isinstance(raw["kda_lower_bound"], int)
    assert raw["head_dim"] == 4 and raw["linear_head_dim"] == 12


def test_plain_q_and_eos_list():
    c = ModelConfig.from_dict({**TINY, "q_lora_rank": None, "eos_token_id": [156895, 156892]})
    assert c.q_lora_rank is None
    assert c.eos_token_ids == (156895, 156892)


def test_truncated_layer_types_are_accepted():
    # transformers keeps 24 layer_types when a model is truncated to fewer layers
    c = ModelConfig.from_dict({**TINY_HF_SAVED, "num_hidden_layers": 8, "mlp_layer_types": None})
    assert c.mla_layers == (3, 7)


BAD = [
    ({"layer_group_size": 5}, "layer_group_size"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_size": "1536"}, "hidden_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"kv_lora_rank": 512.0}, "kv_lora_rank"),
    ({"q_lora_rank": "256"}, "q_lora_rank"),
    ({"kda_lower_bound": "-5"}, "kda_lower_bound"),
    ({"kda_lower_bound": 1}, "kda_lower_bound"),
    ({"kda_safe_gate": 1}, "kda_safe_gate"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"qk_rope_head_dim": 63, "qk_head_dim": 191}, "qk_rope_head_dim"),
    ({"qk_head_dim": 100}, "qk_head_dim"),
    ({"n_group": 7}, "n_group"),
    ({"n_group": 128, "topk_group": 4}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 65}, "num_experts_per_tok"),
    ({"first_k_dense_replace": 25}, "first_k_dense_replace"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": "yarn"}, "rope_scaling"),
    ({"rope_theta": -1}, "rope_theta"),
    ({"expert_swiglu_limit_list": [0] * 20 + [7] * 4}, "expert_swiglu_limit_list"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"score_function": "softmax"}, "score_function"),
    ({"model_type": "llama"}, "model_type"),
    ({"layer_types": ["linear_attention"] * 24}, "layer_types"),
    ({"eos_token_id": 157184}, "eos_token_id"),
    ({"eos_token_id": ["x"]}, "eos_token_id"),
]


@pytest.mark.parametrize(("patch", "key"), BAD, ids=[k for _, k in BAD])
def test_nonsense_is_rejected_naming_the_key(patch, key):
    d = {**TINY, **patch}
    for k, v in patch.items():
        if v is None:
            del d[k]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert e.value.key == key
    assert repr(key) in str(e.value)


def test_missing_dims_name_the_key():
    for key in ("vocab_size", "kv_lora_rank", "v_head_dim", "moe_intermediate_size"):
        d = {k: v for k, v in TINY.items() if k != key}
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_dict(d)
    with pytest.raises(ConfigError, match="head_dim"):
        ModelConfig.from_dict({k: v for k, v in TINY.items() if k != "head_dim"})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="object"):
        ModelConfig.from_file(tmp_path / "config.json")
    assert issubclass(ConfigError, ValueError)

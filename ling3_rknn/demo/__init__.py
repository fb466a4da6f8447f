"""The built-in demo model: what ``ling3-rknn serve --demo`` (``make serve``) runs.

Until a trained demo model exists this is an UNTRAINED PLACEHOLDER: a tiny Ling-3.0
(same architecture, 8 layers: 6 KDA + 2 MLA, MoE with 8 experts, vocab 1024) with weights
drawn deterministically from a fixed seed at start-up, and the compact test tokenizer
(Ling's special tokens at ids 0..13, shipped here as ``tokenizer.json``). It exercises
the whole product path (HF checkpoint loader, numpy model, engine, prefix cache, server)
from an installed package, with nothing downloaded; its text is gibberish.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from ling3_rknn.config import ModelConfig

SEED = 20260601
DEMO_MODEL_ID = "ling-3.0-tiny-demo"
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["BailingHybridForCausalLM"],
    "model_type": "bailing_hybrid",
    "vocab_size": 1024,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 8,
    "layer_group_size": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 12,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4,
    "v_head_dim": 10,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,  # <|role_end|> in the compact tokenizer
    "bos_token_id": None,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


def tokenizer_path() -> Path:
    return Path(str(resources.files(__name__).joinpath("tokenizer.json")))


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes (ling3-model.md 4.1, checkpoint-native names)."""
    d, v = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.word_embeddings.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    p, heads = c.kda_proj_dim, c.num_attention_heads
    for i in range(c.num_hidden_layers):
        layer, attn = f"model.layers.{i}.", f"model.layers.{i}.attention."
        shapes[layer + "input_layernorm.weight"] = (d,)
        shapes[layer + "post_attention_layernorm.weight"] = (d,)
        if i in c.kda_layers:
            for name in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
                shapes[f"{attn}{name}.weight"] = (p, d)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                shapes[f"{attn}{name}.weight"] = (p, 1, c.short_conv_kernel_size)
            shapes[attn + "dt_bias"] = (p,)
            shapes[attn + "A_log"] = (heads,)
            shapes[attn + "b_proj.weight"] = (heads, d)
            shapes[attn + "o_norm.weight"] = (c.kda_head_dim,)
            shapes[attn + "dense.weight"] = (d, p)
        else:
            assert c.q_lora_rank is not None
            shapes[attn + "q_a_proj.weight"] = (c.q_lora_rank, d)
            shapes[attn + "q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[attn + "q_b_proj.weight"] = (heads * c.qk_head_dim, c.q_lora_rank)
            shapes[attn + "kv_a_proj_with_mqa.weight"] = (c.latent_dim, d)
            shapes[attn + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
            shapes[attn + "kv_b_proj.weight"] = (
                heads * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            )
            shapes[attn + "g_proj.weight"] = (heads, d)
            shapes[attn + "dense.weight"] = (d, heads * c.v_head_dim)
        mlp = layer + "mlp."
        if not c.is_moe_layer(i):
            shapes[mlp + "gate_proj.weight"] = (c.intermediate_size, d)
            shapes[mlp + "up_proj.weight"] = (c.intermediate_size, d)
            shapes[mlp + "down_proj.weight"] = (d, c.intermediate_size)
            continue
        n, s = c.moe_intermediate_size, c.shared_intermediate_size
        shapes[mlp + "gate.weight"] = (c.num_experts, d)
        shapes[mlp + "gate.expert_bias"] = (c.num_experts,)
        for e in range(c.num_experts):
            shapes[f"{mlp}experts.{e}.gate_proj.weight"] = (n, d)
            shapes[f"{mlp}experts.{e}.up_proj.weight"] = (n, d)
            shapes[f"{mlp}experts.{e}.down_proj.weight"] = (d, n)
        shapes[mlp + "shared_experts.gate_proj.weight"] = (s, d)
        shapes[mlp + "shared_experts.up_proj.weight"] = (s, d)
        shapes[mlp + "shared_experts.down_proj.weight"] = (d, s)
    return shapes


def random_weights(c: ModelConfig, seed: int = SEED) -> dict[str, np.ndarray]:
    """Deterministic weights with the oracle fixtures' scales (ling3-model.md Appendix A),
    so every component contributes and activations stay finite."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in tensor_shapes(c).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.word_embeddings.weight":
            value = rng.standard_normal(shape)
        elif name.endswith("conv1d.weight"):
            value = 0.5 * rng.standard_normal(shape)
        elif name.endswith("A_log"):
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            value = dt + np.log(-np.expm1(-dt))  # inverse softplus, as HF initialises it
        elif name.endswith("expert_bias"):
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * shape[-1] ** -0.5
        out[name] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def write_checkpoint(
    directory: Path, config: dict[str, Any] = DEMO_CONFIG, seed: int = SEED
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of the random model into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    parsed = ModelConfig.from_dict(config)
    save_file(random_weights(parsed, seed), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@functools.lru_cache(maxsize=1)
def checkpoint_dir() -> Path:
    """The demo checkpoint, generated once per process into a private temporary folder
    (removed at exit; experts are memory-mapped from it while the model lives)."""
    directory = Path(tempfile.mkdtemp(prefix="ling3-demo-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return write_checkpoint(directory)


def load_demo_engine(**options: Any) -> Any:
    """An ``Engine`` serving the demo model; ``options`` go to the Engine constructor."""
    from ling3_rknn.engine import Engine
    from ling3_rknn.model import Model
    from ling3_rknn.tokenizer import Tokenizer

    model = Model.from_hf(checkpoint_dir())
    options.setdefault("model_id", DEMO_MODEL_ID)
    options.setdefault("max_context", model.config.max_position_embeddings)
    return Engine(model, Tokenizer.from_file(tokenizer_path()), **options)

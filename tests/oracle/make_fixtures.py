"""Regenerate the transformers-5.24.0 oracle fixtures in ``tests/fixtures/oracle/``.

Run with the oracle venv (``make oracle-env``):
``.venv-oracle/bin/python tests/oracle/make_fixtures.py``.
Each fixture is a tiny random ``BailingHybridForCausalLM`` (weights re-drawn so every component
matters: transformers' default init gives logits too small to tell components apart; the
re-draw is in ``build`` below) saved as ``config.json`` + ``model.safetensors`` plus
``reference.npz`` with the transformers logits. The three fixtures cover the checkpoint
spellings the loader must accept:

- ``lora_hfsave``: ``q_lora_rank`` set; files exactly as ``save_pretrained`` writes them (KDA
  output ``attention.dense``, per-expert tensors, separate q/k/v convs, renamed config keys),
  with ``kda_lower_bound`` patched to the integer ``-5`` as in the released config.
- ``plainq_released``: ``q_lora_rank: null``; the released checkpoint's names
  (``attention.o_proj``) and config keys (``num_local_experts``, ``head_dim`` = KDA head dim).
- ``lora_hfmodule_bf16``: transformers' in-memory module names (``self_attn``, merged
  ``conv1d``, merged ``experts.gate_up_proj``/``down_proj``, ``e_score_correction_bias``),
  weights stored as bfloat16 (the model is rounded to bf16 first, so the fp32 reference is exact),
  ``norm_topk_prob: false`` and a two-layer hybrid group.
- ``kernel_widths``: 16 heads and a KDA head dim of 16, the widths the compiled kernels
  take (``kda_chunk.c``, ``kda_decode.c``'s vector path, ``mla_attention.c``'s 16-head
  lanes), so the oracle holds the compiled glue too; the others' widths (12, 4 heads) run
  the numpy glue.

``make_fixtures.py NAME...`` writes only the named fixtures (each keeps its seed).

Every fixture is reloaded with ``from_pretrained`` and must reproduce the reference logits
bit-for-bit, so the files on disk are exactly the model that produced the numbers.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import BailingHybridConfig, BailingHybridForCausalLM

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "oracle"
SEQ_LEN = 150
PREFILL = 70
PROMPT = 12
NEW_TOKENS = 20

BASE = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=8,
    layer_group_size=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=12,  # KDA head dim: P = 48 != hidden, so transposition bugs show
    kv_lora_rank=12,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=10,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    short_conv_kernel_size=4,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    tie_word_embeddings=False,
    num_mtp_layers=0,
)

FIXTURES = {
    "lora_hfsave": dict(BASE, q_lora_rank=16),
    "plainq_released": dict(
        BASE,
        q_lora_rank=None,
        num_local_experts=12,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=2,
        rope_theta=6_000_000.0,
    ),
    "lora_hfmodule_bf16": dict(
        BASE,
        q_lora_rank=16,
        layer_group_size=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
    ),
    "kernel_widths": dict(
        BASE,
        q_lora_rank=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=16,
    ),
}

# transformers' save_pretrained spelling -> the released config.json spelling.
RELEASED_KEYS = {
    "model_max_length": "max_position_embeddings",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "num_shared_experts": "n_shared_experts",
}


def build(name: str, kwargs: dict, seed: int) -> BailingHybridForCausalLM:
    torch.manual_seed(seed)
    model = BailingHybridForCausalLM(BailingHybridConfig(**kwargs)).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif n.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            elif n.endswith(("A_log", "dt_bias")):
                # HF's init; stronger random gates make transformers' own chunked and
                # recurrent KDA kernels disagree by ~1e-4 in fp32, too close to the tolerance.
                continue
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        if name.endswith("bf16"):
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(b.bfloat16().float())
    return model


def reference(model: BailingHybridForCausalLM, seed: int) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (1, SEQ_LEN), generator=g)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :PREFILL], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for t in range(PREFILL, SEQ_LEN):
            o = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = o.cache
            steps.append(o.logits)
        inc = torch.cat(steps, 1)
        prompt = ids[:, :PROMPT]
        gen = model.generate(
            prompt,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_cache=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    drift = (inc - full).abs().max().item()
    assert drift < 1e-4, f"transformers incremental vs full drift {drift}"
    print(f"  |logits| max {full.abs().max().item():.2f}, incremental drift {drift:.1e}")
    return dict(
        input_ids=ids[0].numpy().astype(np.int64),
        logits_full=full[0].numpy().astype(np.float32),
        logits_incremental=inc[0].numpy().astype(np.float32),
        prefill_len=np.array(PREFILL, dtype=np.int64),
        generate_prompt=prompt[0].numpy().astype(np.int64),
        generate_out=gen[0].numpy().astype(np.int64),
        transformers_version=np.array(transformers.__version__),
    )


def write_hfsave(model: BailingHybridForCausalLM, out: Path) -> None:
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["kda_lower_bound"] = -5  # the released file's integer spelling
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_released(model: BailingHybridForCausalLM, out: Path) -> None:
    model.save_pretrained(out)
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        is_kda = layer is not None and model.config.layer_types[layer] == "linear_attention"
        if is_kda and name.endswith("attention.dense.weight"):
            name = name.replace("attention.dense.weight", "attention.o_proj.weight")
        renamed[name] = t.contiguous()
    assert any("attention.o_proj" in n for n in renamed)
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((out / "config.json").read_text())
    config = {RELEASED_KEYS.get(k, k): v for k, v in saved.items()}
    config["head_dim"] = saved["linear_head_dim"]  # released: head_dim is the KDA head dim
    for key in (
        "linear_head_dim",
        "linear_num_heads",
        "linear_conv_kernel_dim",
        "layer_types",
        "mlp_layer_types",
        "qk_head_dim",
        "rope_parameters",
    ):
        config.pop(key)
    config.update(
        architectures=["BailingMoeV3ForCausalLM"],
        rope_scaling=None,
        rope_interleave=True,
        partial_rotary_factor=0.5,
        rotary_dim=config["qk_rope_head_dim"],
        num_kv_heads_for_linear_attn=0,
        use_kda_lora=False,
        no_kda_lora=True,
        score_function="sigmoid",
        topk_method="noaux_tc",
        router_dtype="fp32",
        moe_router_enable_expert_bias=True,
        gated_attention_proj_granularity_type="head_wise",
        moe_shared_expert_intermediate_size=config["moe_intermediate_size"],
        expert_swiglu_limit_list=None,
        share_expert_swiglu_limit_list=None,
        kda_lower_bound=-5,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_module_bf16(model: BailingHybridForCausalLM, out: Path) -> None:
    model.save_pretrained(out)  # for config.json; tensors are replaced below
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    assert "model.layers.0.self_attn.conv1d.weight" in state
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def reload_matches(out: Path, ref: dict[str, np.ndarray]) -> None:
    """from_pretrained on the written files must reproduce the reference exactly."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in out.iterdir():
            shutil.copy(f, tmp)
        cfg_path = Path(tmp) / "config.json"
        config = json.loads(cfg_path.read_text())
        config["kda_lower_bound"] = float(config["kda_lower_bound"])  # HF's strict float check
        cfg_path.write_text(json.dumps(config))
        model = BailingHybridForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(ref["input_ids"])[None], use_cache=False).logits
    diff = np.abs(logits[0].numpy() - ref["logits_full"]).max()
    assert diff == 0.0, f"{out.name}: reloaded files differ from the reference model by {diff}"


WRITERS = {
    "lora_hfsave": write_hfsave,
    "plainq_released": write_released,
    "lora_hfmodule_bf16": write_module_bf16,
    "kernel_widths": write_hfsave,
}


def main(argv: list[str]) -> int:
    assert transformers.__version__ == "5.24.0", transformers.__version__
    unknown = set(argv) - set(FIXTURES)
    if unknown:
        raise SystemExit(f"no such fixture: {', '.join(sorted(unknown))}")
    torch.set_num_threads(1)  # deterministic reductions
    for seed, (name, kwargs) in enumerate(FIXTURES.items()):
        if argv and name not in argv:
            continue
        print(name)
        model = build(name, kwargs, seed)
        ref = reference(model, seed + 100)
        out = OUT / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        WRITERS[name](model, out)
        for extra in ("generation_config.json",):
            (out / extra).unlink(missing_ok=True)
        np.savez_compressed(out / "reference.npz", **ref)
        reload_matches(out, ref)
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

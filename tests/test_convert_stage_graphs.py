"""Each ONNX stage graph against its numpy reference (ling3_rknn.model.stages), fp32.

Built from every tiny oracle checkpoint (KDA and MLA layers, plain and low-rank query,
dense and MoE FFN, bf16 storage) and run by onnxruntime at T = 1 and at a prefill width.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from conftest import ORACLE_DIR, ORACLE_FIXTURES

from convert.stage_graphs import (
    expert_graph,
    final_graph,
    kda_input_graph,
    kda_output_graph,
    mla_input_graph,
    mla_output_graph,
    stage_names,
)
from ling3_rknn.config import ModelConfig
from ling3_rknn.model import Checkpoint
from ling3_rknn.model.stages import (
    final_stage,
    kda_core_norm,
    kda_input_stage,
    kda_output_stage,
    mla_input_stage,
    mla_output_stage,
    safe_gate_log_decay,
    swiglu,
)
from ling3_rknn.model.weights import CheckpointWeights

TOL = 2e-5


@pytest.fixture(scope="module", params=ORACLE_FIXTURES)
def weights(request) -> CheckpointWeights:
    path = ORACLE_DIR / request.param
    cfg = ModelConfig.from_file(path / "config.json")
    return CheckpointWeights(Checkpoint.open(path), cfg)


def run(graph, *inputs: np.ndarray) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(graph.model.SerializeToString(),
                                providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == list(graph.inputs)
    feeds = {n: x[None].astype(np.float32) for n, x in zip(graph.inputs, inputs, strict=True)}
    return {n: v[0] for n, v in zip(graph.outputs, sess.run(list(graph.outputs), feeds),
                                    strict=True)}


def close(a: np.ndarray, b: np.ndarray) -> None:
    b = b.reshape(a.shape)
    scale = max(1.0, float(np.abs(b).max()))
    assert float(np.abs(a - b).max()) <= TOL * scale


@pytest.mark.parametrize("t", [1, 7])
def test_layer_stages_match_numpy(weights: CheckpointWeights, t: int) -> None:
    cfg = weights.cfg
    rng = np.random.default_rng(t)
    h = cfg.num_attention_heads
    for i, kind in enumerate(cfg.layer_kinds):
        x = rng.normal(size=(t, cfg.hidden_size)).astype(np.float32)
        out_w = weights.output(i)
        if kind == "kda":
            in_w = weights.kda_input(i)
            got = run(kda_input_graph("s", in_w, cfg), x)
            if cfg.kda_safe_gate:  # the CPU half of the safe gate
                got["log_decay"] = safe_gate_log_decay(got.pop("forget_logit"),
                                                       cfg.kda_lower_bound)
            ref = kda_input_stage(x, in_w, num_heads=h, head_dim=cfg.kda_head_dim,
                                  eps=cfg.rms_norm_eps, safe_gate=cfg.kda_safe_gate,
                                  lower_bound=cfg.kda_lower_bound)
            for name in ("qkv", "log_decay", "beta", "out_gate"):
                close(got[name], getattr(ref, name))
            # heads of very different size (a prompt's first token is ~5x smaller): the
            # CPU half of o_norm must make the graph agree whatever the scale
            scale = 10.0 ** rng.uniform(-3, 1, size=(t, h, 1))
            core = (rng.normal(size=(t, h, cfg.kda_head_dim)) * scale).astype(np.float32)
            graph = kda_output_graph("s", out_w, cfg)
            normed = kda_core_norm(core, cfg.rms_norm_eps)
            got = run(graph, x, normed.reshape(t, -1), ref.out_gate.reshape(t, -1))
            out = kda_output_stage(x, core, ref.out_gate, out_w, eps=cfg.rms_norm_eps)
        else:
            in_w = weights.mla_input(i)
            got = run(mla_input_graph("s", in_w, cfg), x)
            ref = mla_input_stage(x, in_w, num_heads=h, qk_head_dim=cfg.qk_head_dim,
                                  kv_lora_rank=cfg.kv_lora_rank,
                                  rope_dim=cfg.qk_rope_head_dim, eps=cfg.rms_norm_eps)
            for name in ("q_latent", "q_rope", "latent", "k_rope", "gate"):
                close(got[name], getattr(ref, name))
            ctx = rng.normal(size=(t, h, cfg.kv_lora_rank)).astype(np.float32)
            got = run(mla_output_graph("s", out_w, cfg), x, ctx.reshape(t, -1), ref.gate)
            out = mla_output_stage(x, ctx, ref.gate, out_w, eps=cfg.rms_norm_eps)
        hidden = x + got["attn_delta"]
        if cfg.is_moe_layer(i):
            close(hidden, out.hidden)
            close(got["moe_input"], out.moe_input)
            close(got["shared"], out.shared)
            close(got["router_logits"], out.router_logits)
        else:
            assert "moe_input" not in got
            close(hidden + got["ffn_delta"], out.hidden)


def test_final_and_expert_graphs(weights: CheckpointWeights) -> None:
    cfg = weights.cfg
    x = np.random.default_rng(0).normal(size=(3, cfg.hidden_size)).astype(np.float32)
    fw = weights.final()
    close(run(final_graph("final", fw, cfg), x)["logits"],
          final_stage(x, fw, eps=cfg.rms_norm_eps))
    split = final_graph("final", fw, cfg, piece=100)  # the real vocab's Concat form
    assert [n.op_type for n in split.model.graph.node].count("MatMul") == 3
    close(run(split, x)["logits"], final_stage(x, fw, eps=cfg.rms_norm_eps))
    layer = cfg.first_k_dense_replace
    gate_up, down = weights.expert(layer, 1)
    close(run(expert_graph("e", gate_up, down, cfg), x)["y"], swiglu(x, gate_up, down))


def test_stage_names_cover_every_layer(weights: CheckpointWeights) -> None:
    names = stage_names(weights.cfg)
    assert len(names) == 2 * weights.cfg.num_hidden_layers + 1
    assert names[-1] == "final" and len(set(names)) == len(names)

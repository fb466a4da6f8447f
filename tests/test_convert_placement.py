"""Placement plan from calibration routing counts: budget, call cap, cores, manifest."""

from __future__ import annotations

import numpy as np
import pytest

from convert.placement import NPU_WINDOW_BYTES, default_npu_budget, plan_placement
from ling3_rknn.bundle import PlacementPlan

LAYERS = [1, 2, 3]
STAGES = [f"layer.{i}.{p}" for i in range(4) for p in ("in", "out")] + ["head"]


def counts_for(rng, tokens, experts=16, k=4, skew=2.0):
    """Routing counts with a realistic skew: a few experts take most tokens."""
    out = np.zeros((len(LAYERS), experts), np.int64)
    p = rng.random(experts) ** skew
    p /= p.sum()
    for j in range(len(LAYERS)):
        for _ in range(tokens):
            out[j, rng.choice(experts, k, replace=False, p=p)] += 1
    return out


def test_most_used_experts_first_within_the_byte_budget():
    rng = np.random.default_rng(0)
    counts = counts_for(rng, 200)
    rep = plan_placement(counts, LAYERS, 200, 4, expert_bytes=100, budget_bytes=550,
                         dense_calls_per_token=9, stage_names=STAGES)
    chosen = [(layer, e) for layer, ids in rep.plan.npu_experts.items() for e in ids]
    assert len(chosen) == 5 and rep.npu_expert_bytes == 500
    top5 = np.argsort(-counts, axis=None, kind="stable")[:5]
    assert sorted(chosen) == sorted((LAYERS[i // 16], i % 16) for i in top5)
    probs = counts / 200
    assert rep.expected_expert_calls_per_token == pytest.approx(
        sum(probs[LAYERS.index(layer), e] for layer, e in chosen))
    assert rep.routed_share_on_npu == pytest.approx(
        sum(counts[LAYERS.index(layer), e] for layer, e in chosen) / counts.sum())


def test_call_cap_limits_promotion():
    rng = np.random.default_rng(1)
    counts = counts_for(rng, 100)
    rep = plan_placement(counts, LAYERS, 100, 4, expert_bytes=1, budget_bytes=10**9,
                         dense_calls_per_token=9, stage_names=STAGES, max_calls_per_token=10.5)
    assert rep.expected_calls_per_token <= 10.5
    assert rep.expected_expert_calls_per_token > 1.0  # filled close to the cap
    unlimited = plan_placement(counts, LAYERS, 100, 4, expert_bytes=1, budget_bytes=10**9,
                               dense_calls_per_token=9, stage_names=STAGES,
                               max_calls_per_token=1e9)
    # with no cap every routed expert is promoted: all selections hit the NPU
    assert unlimited.routed_share_on_npu == pytest.approx(1.0)
    assert unlimited.expected_expert_calls_per_token == pytest.approx(3 * 4)


def test_unrouted_experts_are_never_promoted():
    counts = np.zeros((3, 8), np.int64)
    counts[:, :2] = 10  # 10 tokens, top-2, only experts 0 and 1 ever chosen
    rep = plan_placement(counts, LAYERS, 10, 2, expert_bytes=1, budget_bytes=100,
                         dense_calls_per_token=9, stage_names=STAGES, max_calls_per_token=1e9)
    assert rep.plan.npu_experts == {1: (0, 1), 2: (0, 1), 3: (0, 1)}


def test_cores_and_manifest_shape():
    counts = np.zeros((3, 8), np.int64)
    counts[:, :2] = 10
    rep = plan_placement(counts, LAYERS, 10, 2, expert_bytes=1, budget_bytes=4,
                         dense_calls_per_token=9, stage_names=STAGES, max_calls_per_token=1e9)
    plan = rep.plan
    assert isinstance(plan, PlacementPlan) and plan.npu_budget_bytes == 4
    assert all(plan.stage_cores[s] == "auto" for s in STAGES)
    expert_cores = [v for k, v in plan.stage_cores.items() if ".expert." in k]
    assert expert_cores == ["0", "1", "2", "0"]  # round-robin over the three cores


def test_zero_budget_means_no_npu_experts():
    counts = np.full((3, 8), 5, np.int64)
    rep = plan_placement(counts, LAYERS, 10, 4, expert_bytes=1, budget_bytes=0,
                         dense_calls_per_token=49, stage_names=STAGES)
    assert rep.plan.npu_experts == {} and rep.expected_calls_per_token == 49


@pytest.mark.parametrize("kwargs,match", [
    ({"route_counts": np.zeros((2, 8))}, "route_counts must be"),
    ({"tokens_routed": 0}, "positive token count"),
    ({"route_counts": np.full((3, 8), 3)}, "exactly top_k"),
    ({"expert_bytes": 0}, "expert_bytes"),
])
def test_bad_inputs(kwargs, match):
    args = {"route_counts": np.full((3, 8), 5), "moe_layers": LAYERS, "tokens_routed": 10,
            "top_k": 4, "expert_bytes": 1, "budget_bytes": 10, "dense_calls_per_token": 9,
            "stage_names": STAGES}
    with pytest.raises(ValueError, match=match):
        plan_placement(**{**args, **kwargs})


def test_default_budget_is_the_window_left_by_the_dense_stages():
    assert default_npu_budget(0) < NPU_WINDOW_BYTES
    assert default_npu_budget(10**9) == default_npu_budget(0) - 10**9
    assert default_npu_budget(5 * 1024**3) == 0

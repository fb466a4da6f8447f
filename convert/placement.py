"""The placement plan: which routed experts also live on the NPU, and on which cores.

Inputs are measured, not guessed: routing counts per (MoE layer, expert) collected by
running the model on calibration prompts, the byte size of one NPU expert graph, and the
NPU-resident bytes of the dense stages. RKNNLite maps every model into one ~4 GB IOMMU
window shared system-wide (rknn-toolkit-lite2 2.5.0, RK3588), so the experts get what the dense
stages leave of it, minus a reserve for the runtime's buffers.

Experts are promoted most-used first (the probability that a token routes to them), as
long as they fit the byte budget and the expected NPU calls per decoded token stay under
a cap: every promoted expert that a token selects costs one more RKNNLite call, and the
per-call overhead is what makes a token slow (a token must take tens of calls, not hundreds).
Promoted experts are spread round-robin over the three cores so a token's NPU experts
can run in parallel; their graphs are named ``layer.<L>.expert.<E>`` in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ling3_rknn.bundle import PlacementPlan, StageName

NPU_WINDOW_BYTES = 4 * 1024**3
DEFAULT_RESERVE_BYTES = 256 * 1024**2  # command buffers, internal tensors, other users
EXPERT_CORES = ("0", "1", "2")


@dataclass(frozen=True)
class PlacementReport:
    plan: PlacementPlan
    npu_expert_bytes: int
    dense_calls_per_token: int
    expected_expert_calls_per_token: float  # promoted experts a token selects, on average
    routed_share_on_npu: float  # fraction of all expert selections that hit the NPU

    @property
    def expected_calls_per_token(self) -> float:
        return self.dense_calls_per_token + self.expected_expert_calls_per_token


def default_npu_budget(dense_stage_bytes: int, window: int = NPU_WINDOW_BYTES,
                       reserve: int = DEFAULT_RESERVE_BYTES) -> int:
    """Bytes left for NPU experts in the shared window after the dense stages."""
    return max(0, window - reserve - dense_stage_bytes)


def plan_placement(
    route_counts: np.ndarray,
    moe_layers: list[int],
    tokens_routed: int,
    top_k: int,
    expert_bytes: int,
    budget_bytes: int,
    dense_calls_per_token: int,
    stage_names: list[str],
    max_calls_per_token: float = 60.0,
) -> PlacementReport:
    """``route_counts[j, e]``: how often expert ``e`` of MoE layer ``moe_layers[j]`` was
    selected over ``tokens_routed`` calibration tokens (each token selects ``top_k``)."""
    counts = np.asarray(route_counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[0] != len(moe_layers):
        raise ValueError(f"route_counts must be [{len(moe_layers)} layers, experts], got "
                         f"{counts.shape}")
    if tokens_routed <= 0 or (counts < 0).any():
        raise ValueError("need a positive token count and non-negative routing counts")
    if (counts.sum(axis=1) != tokens_routed * top_k).any():
        raise ValueError("every calibration token must select exactly top_k experts per layer")
    if expert_bytes <= 0 or budget_bytes < 0:
        raise ValueError("expert_bytes must be positive and the budget non-negative")
    prob = counts / tokens_routed  # P(token selects expert) per layer
    order = np.argsort(-prob, axis=None, kind="stable")
    chosen: dict[int, list[int]] = {}
    used = 0
    calls = 0.0
    for flat in order:
        j, e = divmod(int(flat), counts.shape[1])
        p = float(prob[j, e])
        if p == 0.0:
            break  # never routed on the calibration set: no evidence it is worth a slot
        if used + expert_bytes > budget_bytes:
            break
        if dense_calls_per_token + calls + p > max_calls_per_token:
            continue  # a less-used expert further down may still fit under the cap
        chosen.setdefault(moe_layers[j], []).append(e)
        used += expert_bytes
        calls += p
    npu_experts = {layer: tuple(sorted(ids)) for layer, ids in sorted(chosen.items())}
    stage_cores = {name: "auto" for name in stage_names}
    for n, (layer, e) in enumerate((layer, e) for layer, ids in npu_experts.items()
                                   for e in ids):
        stage_cores[str(StageName.npu_expert(layer, e))] = EXPERT_CORES[n % len(EXPERT_CORES)]
    share = float(sum(counts[moe_layers.index(layer), list(ids)].sum()
                      for layer, ids in npu_experts.items()) / counts.sum())
    return PlacementReport(
        plan=PlacementPlan(stage_cores=stage_cores, npu_experts=npu_experts,
                           npu_budget_bytes=budget_bytes),
        npu_expert_bytes=used,
        dense_calls_per_token=dense_calls_per_token,
        expected_expert_calls_per_token=calls,
        routed_share_on_npu=share,
    )

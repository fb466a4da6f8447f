"""Weights the CPU glue needs and the NPU never sees: KDA conv taps, expert-selection bias,
the MLA key/value bases of the expanded prefill form."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .mla_expanded import MlaBases, mla_bases
from .weights import CheckpointWeights


@dataclass(frozen=True)
class CpuWeights:
    """Weights the CPU glue needs (they never go to the NPU); a bundle loader builds the
    same object from its own files."""

    conv: dict[int, np.ndarray]  # KDA layer -> conv taps [K, 3P] (tap-major)
    expert_bias: dict[int, np.ndarray]  # MoE layer -> [E]
    # MLA layer -> bases (mla_expanded.py); empty (an older bundle): prefill stays absorbed
    mla_bases: dict[int, MlaBases] = field(default_factory=dict)

    @classmethod
    def from_checkpoint(cls, w: CheckpointWeights) -> CpuWeights:
        c = w.cfg
        return cls(
            conv={i: np.ascontiguousarray(w.kda_conv(i).T) for i in c.kda_layers},
            expert_bias={
                i: np.array(w.expert_bias(i))
                for i in range(c.num_hidden_layers)
                if c.is_moe_layer(i)
            },
            mla_bases={i: mla_bases(*w.mla_absorbed(i)) for i in c.mla_layers},
        )

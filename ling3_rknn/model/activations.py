"""Elementwise and normalisation math shared by the stages, the experts and the glue."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis (transformers' RMSNorm)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88 (float32), which still gives the right 0; only the
    # warning is silenced. Measured ~1.5x faster here than the tanh form and the two-branch form.
    with np.errstate(over="ignore"):
        y = np.exp(-x)
    y += np.float32(1.0)
    return np.reciprocal(y, out=y)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu(x: np.ndarray, gate_up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down @ (silu(gate @ x) * (up @ x)); ``gate_up`` stacks gate rows then up rows."""
    h = x @ gate_up.T
    inter = gate_up.shape[0] // 2
    return (silu(h[..., :inter]) * h[..., inter:]) @ down.T

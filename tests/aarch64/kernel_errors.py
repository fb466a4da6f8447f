"""Max error of each compiled glue kernel against its numpy reference, as JSON.

The figure is tests/test_native_kernels.py's measure (largest absolute difference over the
largest reference value; the tests hold it under 1e-5) on one case per kernel and cache
dtype at Ling-3.0-tiny's dimensions. The aarch64 tier prints the emulated board's figures
beside the x86 host's (``--compare``); a kernel that did not build or declined the input
is an error, not a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ling3_rknn.model import mla, native
from ling3_rknn.model.kda import (
    RecurrentState,
    kda_decode,
    kda_recurrent,
    prepare_qkv,
    short_conv,
)

HEADS, R, ROPE = 16, 512, 64  # Ling-3.0-tiny's MLA: heads, latent rank, rope channels
KDA_HEADS, KDA_D, TAPS = 16, 128, 4  # its KDA layers
LENGTHS = [256, 256, 100]  # cache blocks: two full, one partial
TOL = 1e-5


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _numpy(fn, *args):
    native.set_enabled(False)
    try:
        return fn(*args)
    finally:
        native.set_enabled(True)


def mla_case(tokens: int, dtype: type) -> float:
    """Decode (one token) or a prefill chunk (``tokens``) over a float32 or float16 cache."""
    rng = np.random.default_rng(tokens)
    blocks = [rng.standard_normal((n, R + ROPE)).astype(dtype) for n in LENGTHS]
    q_latent = rng.standard_normal((tokens, HEADS, R)).astype(np.float32)
    q_rope = rng.standard_normal((tokens, HEADS, ROPE)).astype(np.float32)
    length = sum(LENGTHS)
    want = _numpy(mla.mla_attention, q_latent, q_rope, blocks, length, 0.07)
    return _rel(mla.mla_attention(q_latent, q_rope, blocks, length, 0.07), want)


def kda_case(steps: int = 40) -> float:
    """``steps`` decode tokens from a random state (the queue fills, flushes and folds);
    the worst token."""
    rng = np.random.default_rng(1)
    p = KDA_HEADS * KDA_D
    body = (0.05 * rng.standard_normal((KDA_HEADS, KDA_D, KDA_D))).astype(np.float32)
    reference, compiled = RecurrentState(body.copy()), RecurrentState(body.copy())
    tail = rng.standard_normal((TAPS - 1, 3 * p)).astype(np.float32)
    compiled_tail = tail.copy()
    taps = (0.5 * rng.standard_normal((TAPS, 3 * p))).astype(np.float32)
    worst = 0.0
    for step in range(steps):
        decay = 5.0 if step < steps // 2 else 60.0
        qkv = rng.standard_normal((1, 3 * p)).astype(np.float32)
        log_decay = (-decay / (1.0 + np.exp(-rng.standard_normal((1, KDA_HEADS, KDA_D))))
                     ).astype(np.float32)
        beta = rng.random((1, KDA_HEADS)).astype(np.float32)
        conv_out, tail = short_conv(qkv, tail, taps)
        q, k, v = prepare_qkv(conv_out, KDA_HEADS, KDA_D)
        want = kda_recurrent(q, k, v, log_decay, beta, reference)
        got = kda_decode(qkv, compiled_tail, taps, log_decay, beta, compiled)
        if got is None:
            raise RuntimeError("the KDA kernel declined the input")
        worst = max(worst, _rel(got, want))
    return max(worst, _rel(compiled.value(), reference.value()))


def measure() -> dict[str, float]:
    if not native.available():
        raise RuntimeError(f"compiled kernels unavailable: {native.status()}")
    return {
        "mla decode, float32 cache": mla_case(1, np.float32),
        "mla decode, float16 cache": mla_case(1, np.float16),
        "mla prefill (64 tokens), float32 cache": mla_case(64, np.float32),
        "mla prefill (64 tokens), float16 cache": mla_case(64, np.float16),
        "kda decode (40 tokens)": kda_case(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="another machine's --out, shown beside")
    args = parser.parse_args()
    errors = measure()
    args.out.write_text(json.dumps(errors, indent=1) + "\n")
    other = json.loads(args.compare.read_text()) if args.compare else {}
    print(f"max error vs numpy (relative to the largest value; tolerance {TOL:g})")
    for name, value in errors.items():
        beside = f"   {args.compare.stem}: {other[name]:.2e}" if name in other else ""
        print(f"  {name:42s} {value:.2e}{beside}")
    print(f"  kernels: {native.status()}")
    return 0 if max(errors.values()) < TOL else 1


if __name__ == "__main__":
    sys.exit(main())

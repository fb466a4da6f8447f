"""What a conversion is asked to do: the options, their defaults and their checks.

The option enums themselves (targets, stage quantizations per target, expert formats)
belong to the bundle format (``ling3_rknn.bundle.format``); this module only says which
combinations the converter accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ling3_rknn.bundle import EXPERT_FORMATS, STAGE_QUANTS, TARGETS

W8A8_ALGORITHMS = ("normal", "mmse", "kl_divergence")
DEFAULT_W8A8_ALGORITHM = "mmse"  # docs/toolchain.md 3: measured on the trained demo
# --target cpu int8/int4: onnxruntime's MatMulNBits, symmetric, this block, activations
# quantized to int8 inside the kernel (accuracy_level 4: the integer dot-product kernels).
CPU_QUANT_BLOCK = 32
CPU_QUANT_ACCURACY_LEVEL = 4


def stage_quant(o: ConvertOptions) -> str:
    """The stage weight format the options ask for (``--quant`` or the target's default)."""
    return o.quant if o.quant is not None else STAGE_QUANTS[o.target][0]


class ConvertError(ValueError):
    """The conversion cannot proceed: bad options or inputs that are not a checkpoint."""


@dataclass(frozen=True)
class ConvertOptions:
    target: str = "rk3588"  # rk3588 | cpu
    # stage weights. rk3588: fp16 | w8a8; cpu: int8 | int4 (onnxruntime MatMulNBits) | fp32.
    # None: the target's default (fp16 for the NPU, int8 for the CPU).
    quant: str | None = None
    experts: str = "int4"  # int4 | int8 | fp16
    calibration: Path | None = None
    # bytes for NPU experts; None: what the window leaves for fp16 experts, 0 for QMoE ones
    npu_budget: int | None = None
    chunk: int = 64  # the smallest prefill shape; calibration cuts its samples to it
    more_chunks: tuple[int, ...] = ()  # bigger prefill shapes of every stage graph
    tokenizer: Path | None = None
    chat_template: Path | None = None
    block_size: int = 32
    calibration_samples: int = 8
    # w8a8 only: rknn-toolkit2's calibration algorithm (normal | mmse | kl_divergence) and
    # the auto-hybrid cosine threshold (ops whose calibration cosine falls below it stay
    # fp16; None: all int8). Recorded per stage in the manifest. mmse by default: it
    # searches each tensor's clipping range, which the demo's exact copies need
    # (docs/toolchain.md 3).
    w8a8_algorithm: str = DEFAULT_W8A8_ALGORITHM
    w8a8_hybrid_cos: float | None = None
    build_rknn: bool = True  # False: placeholder .rknn files (host tests only)
    overwrite: bool = False
    resume: bool = False
    progress: bool = True
    max_calls_per_token: float = 60.0
    # the routed experts' int8 copy for prefill on the NPU (its own files beside the CPU
    # copy; loaded only where the board's memory allows). None: on for rk3588, off for cpu.
    npu_experts: bool | None = None

    @property
    def writes_npu_experts(self) -> bool:
        return self.target == "rk3588" if self.npu_experts is None else self.npu_experts

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Every prefill shape, smallest first (the manifest's ``chunk_sizes``)."""
        return tuple(sorted({self.chunk, *self.more_chunks}))


def check_options(o: ConvertOptions) -> None:
    """Every option combination the converter refuses, before any work."""
    if o.target not in TARGETS:
        raise ConvertError(f"--target must be rk3588 or cpu, not {o.target!r}")
    allowed = STAGE_QUANTS[o.target]
    if o.quant is not None and o.quant not in allowed:
        raise ConvertError(f"--quant for --target {o.target} must be one of "
                           f"{', '.join(allowed)}, not {o.quant!r}")
    if o.experts not in EXPERT_FORMATS:
        raise ConvertError(f"--experts must be int4, int8 or fp16, not {o.experts!r}")
    if o.w8a8_algorithm not in W8A8_ALGORITHMS:
        raise ConvertError(f"w8a8 algorithm must be one of {W8A8_ALGORITHMS}, "
                           f"not {o.w8a8_algorithm!r}")
    if o.w8a8_hybrid_cos is not None and not 0.0 < o.w8a8_hybrid_cos < 1.0:
        raise ConvertError(f"w8a8 hybrid cosine threshold must be in (0, 1), "
                           f"got {o.w8a8_hybrid_cos}")
    if o.chunk < 2:
        raise ConvertError(f"--chunk must be at least 2, got {o.chunk}")
    if any(c <= o.chunk for c in o.more_chunks):
        raise ConvertError(f"more chunk sizes {list(o.more_chunks)} must each be bigger than "
                           f"--chunk {o.chunk}")
    if o.npu_experts and o.target != "rk3588":
        raise ConvertError("--npu-experts needs --target rk3588 (the copy is for the NPU)")
    if o.npu_budget is not None and o.npu_budget < 0:
        raise ConvertError("--npu-budget must not be negative")

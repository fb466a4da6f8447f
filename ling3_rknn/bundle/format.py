"""The bundle format's vocabulary, spelled once: version, the option enums, stage names,
the CPU-weights keys and the placeholder magic.

A bundle is a directory with ``manifest.json`` and the files it lists. The manifest is
the single source of truth the runtime follows: model config, the NPU stages (``.rknn``
+ ONNX twin, quantization, input/output names, static shape sets), the routed-expert
format, the placement plan (cores per stage, experts promoted to the NPU), chunk sizes,
tokenizer / chat-template hashes and the size + sha256 of every file (docs/bundle-format.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FORMAT = "ling3-rknn-bundle"
# 2: KDA output stages take ``core_normed`` (the CPU does o_norm's scale-free half)
# 3: the optional int8 copy of the routed experts for NPU matmuls (``npu_matmul_experts``)
FORMAT_VERSION = 3
# Versions this runtime reads: a version-2 bundle is a version-3 one without the copy.
READABLE_FORMAT_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
# An NPU graph (a stage with an .rknn) is fp16 or w8a8; fp32 and MatMulNBits int8/int4 exist
# only as ONNX graphs run by onnxruntime (--target cpu).
NPU_QUANT_TYPES = ("fp16", "w8a8")
CPU_QUANT_TYPES = ("int8", "int4", "fp32")
QUANT_TYPES = ("fp32", *NPU_QUANT_TYPES, "int8", "int4")
TARGETS = ("rk3588", "cpu")
# Stage weight formats per target; the first is the converter's default.
STAGE_QUANTS = {"rk3588": NPU_QUANT_TYPES, "cpu": CPU_QUANT_TYPES}
EXPERT_FORMATS = ("int4", "int8", "fp16")
QMOE_FORMATS = ("int4", "int8")  # expert formats run by onnxruntime's QMoE kernel
# The routed experts' second copy for prefill on the NPU's matmul API: int8 weights with a
# float32 scale per output channel, laid out as the matmul's B [k, n] (docs/bundle-format.md)
NPU_MATMUL_EXPERT_FORMATS = ("int8",)
# The placement plan's core masks: the names ``ling3_rknn.npu.CORE_MASKS`` maps to RKNNLite's
# NPU_CORE_* values (npu and bundle never import each other; a test holds the two equal).
CORE_MASK_NAMES = ("auto", "0", "1", "2", "0_1", "0_1_2", "all")
# The first bytes of the stand-in ``.rknn`` a conversion without rknn-toolkit2 writes
# (``--no-rknn-build``): only the RKNNLite mock, which runs the ONNX twin, may load it.
PLACEHOLDER_MAGIC = b"LING3-RKNN-PLACEHOLDER\n"


# -- the CPU weights file (the glue's tensors: the NPU never sees them) ---------------
WEIGHTS_FILE = "weights.safetensors"
EMBEDDING_KEY = "embedding"  # [vocab, hidden], fp16 or fp32


def conv_key(layer: int) -> str:
    """KDA short-conv taps of ``layer``, float32 ``[K, 3P]`` (tap-major)."""
    return f"conv.{layer}"


def expert_bias_key(layer: int) -> str:
    """Expert-selection bias of MoE ``layer``, float32 ``[E]``."""
    return f"expert_bias.{layer}"


def mla_key_basis_key(layer: int) -> str:
    """Orthonormal basis of MLA ``layer``'s key subspaces, float32 ``[H, r_kv, d_nope]``
    (the expanded prefill form, docs/model.md; optional: without it prefill stays absorbed)."""
    return f"mla_key_basis.{layer}"


def mla_value_basis_key(layer: int) -> str:
    """Orthonormal basis of MLA ``layer``'s value subspaces, float32 ``[H, r_kv, d_v]``."""
    return f"mla_value_basis.{layer}"


# -- stage names ------------------------------------------------------------------------
StageRole = Literal["in", "out", "expert", "final"]


@dataclass(frozen=True)
class StageName:
    """A stage's name as a value: ``layer.N.in``, ``layer.N.out``, ``layer.N.expert.E``
    (a routed expert promoted to the NPU) or ``final``. ``str()`` is the manifest key."""

    role: StageRole
    layer: int | None = None
    expert: int | None = None

    @classmethod
    def layer_in(cls, layer: int) -> StageName:
        return cls("in", layer)

    @classmethod
    def layer_out(cls, layer: int) -> StageName:
        return cls("out", layer)

    @classmethod
    def npu_expert(cls, layer: int, expert: int) -> StageName:
        return cls("expert", layer, expert)

    @classmethod
    def final(cls) -> StageName:
        return cls("final")

    @classmethod
    def parse(cls, text: str) -> StageName:
        """The inverse of ``str()``; ValueError for anything else."""
        if text == "final":
            return cls.final()
        parts = text.split(".")
        ok = parts[0] == "layer" and len(parts) >= 3 and parts[1].isdigit()
        if ok and len(parts) == 3 and parts[2] in ("in", "out"):
            return cls(parts[2], int(parts[1]))  # type: ignore[arg-type]
        if ok and len(parts) == 4 and parts[2] == "expert" and parts[3].isdigit():
            return cls.npu_expert(int(parts[1]), int(parts[3]))
        raise ValueError(f"{text!r} is not a stage name (layer.N.in | layer.N.out | "
                         "layer.N.expert.E | final)")

    def __str__(self) -> str:
        if self.role == "final":
            return "final"
        if self.role == "expert":
            return f"layer.{self.layer}.expert.{self.expert}"
        return f"layer.{self.layer}.{self.role}"

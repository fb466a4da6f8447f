"""The bundle's non-graph files: routed experts per MoE layer and the CPU weights file."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

from convert.experts_quant import pack_experts, pack_matmul_experts
from convert.options import ConvertError
from convert.qmoe_graph import write_qmoe_layer
from ling3_rknn.bundle import (
    EMBEDDING_KEY,
    WEIGHTS_FILE,
    BundleWriter,
    conv_key,
    expert_bias_key,
    mla_key_basis_key,
    mla_value_basis_key,
)
from ling3_rknn.config import ModelConfig
from ling3_rknn.model.mla_expanded import mla_bases
from ling3_rknn.model.weights import CheckpointWeights
from ling3_rknn.npu.experts import PackedExperts


def expert_block(cfg: ModelConfig, wanted: int) -> int:
    """Largest power-of-two block <= ``wanted`` (and >= 16) dividing D and I."""
    block = wanted
    while block >= 16:
        if cfg.hidden_size % block == 0 and cfg.moe_intermediate_size % block == 0:
            return block
        block //= 2
    raise ConvertError(f"hidden {cfg.hidden_size} / expert width {cfg.moe_intermediate_size} "
                       "have no common power-of-two block >= 16 for QMoE; use --experts fp16")


def _pack_layer(w: CheckpointWeights, layer: int, bits: int, block: int) -> PackedExperts:
    """One expert at a time, so a bf16 layer is never widened whole."""
    cfg = w.cfg
    i = cfg.moe_intermediate_size

    def load(x: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        gate_up, down = w.expert(layer, x)
        return gate_up[:i], gate_up[i:], down

    return pack_experts(cfg.num_experts, i, cfg.hidden_size, load, bits, block)


def write_experts(writer: BundleWriter, w: CheckpointWeights, layer: int, fmt: str,
                   block: int) -> dict[str, str]:
    cfg = w.cfg
    rel = f"experts/layer_{layer:02d}"
    entry = {"weights": rel + ".safetensors"}
    if fmt == "fp16":
        if not writer.done(entry["weights"]):
            i = cfg.moe_intermediate_size
            gate = np.empty((cfg.num_experts, i, cfg.hidden_size), np.float16)
            up = np.empty_like(gate)
            down = np.empty((cfg.num_experts, cfg.hidden_size, i), np.float16)
            for x in range(cfg.num_experts):
                gate_up, dn = w.expert(layer, x)
                gate[x], up[x], down[x] = gate_up[:i], gate_up[i:], dn
            save_file({"gate": gate, "up": up, "down": down}, writer.path(entry["weights"]))
            writer.record(entry["weights"])
        return entry
    entry["onnx"] = rel + ".onnx"
    if writer.done(entry["weights"]) and writer.done(entry["onnx"]):
        return entry
    packed = _pack_layer(w, layer, 4 if fmt == "int4" else 8, block)
    save_file(packed.tensors(), writer.path(entry["weights"]))
    writer.record(entry["weights"])
    write_qmoe_layer(packed, writer.path(entry["weights"]), writer.path(entry["onnx"]),
                     cfg.num_experts_per_tok)
    writer.record(entry["onnx"])
    return entry


def npu_experts_path(layer: int) -> str:
    return f"experts/layer_{layer:02d}.npu.safetensors"


def write_npu_experts(writer: BundleWriter, w: CheckpointWeights, layer: int) -> str:
    """MoE ``layer``'s int8 copy for the NPU's matmuls (``Int8MatmulExperts``), from the
    checkpoint's float weights (not from the CPU copy: int4 would add its error), one
    expert at a time."""
    rel = npu_experts_path(layer)
    if writer.done(rel):
        return rel
    cfg = w.cfg
    i = cfg.moe_intermediate_size

    def load(x: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        gate_up, down = w.expert(layer, x)
        return gate_up[:i], gate_up[i:], down

    packed = pack_matmul_experts(cfg.num_experts, i, cfg.hidden_size, load)
    save_file(packed.tensors(), writer.path(rel))
    writer.record(rel)
    return rel


def write_cpu_weights(writer: BundleWriter, w: CheckpointWeights) -> None:
    """Embedding table (fp16 when the checkpoint stores 16-bit floats and fp16 holds them,
    else fp32), KDA conv taps [K, 3P], MoE expert biases and the MLA key/value bases, all
    for the CPU glue."""
    if writer.done(WEIGHTS_FILE):
        return
    cfg = w.cfg
    name = "model.word_embeddings.weight"
    table = w.ckpt.tensor(name, (cfg.vocab_size, cfg.hidden_size))
    f, stored = w.ckpt.locate(name, (cfg.vocab_size, cfg.hidden_size))
    if f.raw(stored).dtype.itemsize == 2:
        half = table.astype(np.float16)
        table = half if np.isfinite(half).all() else table
    tensors = {EMBEDDING_KEY: np.ascontiguousarray(table)}
    for i in cfg.kda_layers:
        tensors[conv_key(i)] = np.ascontiguousarray(w.kda_conv(i).T, dtype=np.float32)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            tensors[expert_bias_key(i)] = np.array(w.expert_bias(i), np.float32)
    for i in cfg.mla_layers:  # the expanded prefill form's bases (docs/model.md, MLA)
        bases = mla_bases(*w.mla_absorbed(i))
        tensors[mla_key_basis_key(i)] = bases.key
        tensors[mla_value_basis_key(i)] = bases.value
    save_file(tensors, writer.path(WEIGHTS_FILE))
    writer.record(WEIGHTS_FILE)

"""ONNX graph of one MoE layer's routed experts: a single ``com.microsoft::QMoE`` node.

The attributes are the set found to work (docs/bundle-format.md 2.6) on onnxruntime 1.32's CPU
kernel: SwiGLU with interleaved gate/up (``swiglu_fusion=1``), alpha 1 / beta 0 for a
plain ``silu(g) * u``, symmetric weights (no zero points), routing computed by the caller
and passed as ``router_weights`` (input 14) with a selection mask as ``router_probs``.

The weights can be embedded (tests, benchmarks) or stored as ONNX external data that
points straight into the bundle's safetensors file, so the bundle keeps one copy of
every expert weight and onnxruntime maps it without a Python-side copy.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ling3_rknn.npu.experts import PackedExperts

OPSET = 17
IR_VERSION = 8  # what onnx<=1.18 (rknn-toolkit2's venv) and onnxruntime 1.32 both read


def build_qmoe_model(
    packed: PackedExperts,
    top_k: int,
    accuracy_level: int = 4,
    external: dict[str, tuple[str, int, int]] | None = None,
) -> onnx.ModelProto:
    """One QMoE node over ``hidden [T, D]``; ``external`` maps tensor name ->
    (file relative to the model, byte offset, byte length) for external data."""
    e, d = packed.num_experts, packed.hidden_size
    inits = []
    for name in PackedExperts.TENSOR_NAMES:
        arr = getattr(packed, name)
        if external is None:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
            continue
        location, offset, length = external[name]
        if length != arr.nbytes:
            raise ValueError(f"external data for {name} is {length} bytes, expected {arr.nbytes}")
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype),
                        dims=list(arr.shape), data_location=TensorProto.EXTERNAL)
        for key, value in (("location", location), ("offset", str(offset)),
                           ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        inits.append(t)
    node = helper.make_node(
        "QMoE",
        ["hidden", "router_probs", "fc1_weight", "fc1_scales", "", "fc2_weight", "fc2_scales",
         "", "", "", "", "", "", "", "router_weights"],
        ["out"],
        domain="com.microsoft",
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=1.0,
        activation_beta=0.0,
        expert_weight_bits=packed.bits,
        block_size=packed.block_size,
        k=top_k,
        normalize_routing_weights=0,
        accuracy_level=accuracy_level,
    )
    graph = helper.make_graph(
        [node], "qmoe",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", d]),
         helper.make_tensor_value_info("router_probs", TensorProto.FLOAT, ["T", e]),
         helper.make_tensor_value_info("router_weights", TensorProto.FLOAT, ["T", e])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", d])],
        initializer=inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="ling3-rknn convert",
    )
    model.ir_version = IR_VERSION
    return model


def safetensors_offsets(path: str | Path) -> dict[str, tuple[int, int]]:
    """Absolute (offset, length) of every tensor's bytes in a safetensors file.

    The format is an 8-byte little-endian header length, a JSON header with
    ``data_offsets`` relative to the end of the header, then the raw bytes.
    """
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {
        name: (base + meta["data_offsets"][0], meta["data_offsets"][1] - meta["data_offsets"][0])
        for name, meta in header.items()
        if name != "__metadata__"
    }


def write_qmoe_layer(
    packed: PackedExperts, weights_file: str | Path, model_file: str | Path, top_k: int,
    prefix: str = "", accuracy_level: int = 4,
) -> None:
    """Write ``model_file`` whose initializers point into ``weights_file``, an existing
    safetensors file (same directory) holding ``packed.tensors(prefix)``."""
    weights_file, model_file = Path(weights_file), Path(model_file)
    if weights_file.parent.resolve() != model_file.parent.resolve():
        raise ValueError("onnxruntime resolves external data next to the model file")
    offsets = safetensors_offsets(weights_file)
    external = {}
    for name in PackedExperts.TENSOR_NAMES:
        if prefix + name not in offsets:
            raise ValueError(f"{weights_file.name} has no tensor {prefix + name}")
        external[name] = (weights_file.name, *offsets[prefix + name])
    model = build_qmoe_model(packed, top_k, accuracy_level, external)
    model_file.write_bytes(model.SerializeToString())

"""Small ONNX graph builder with the op vocabulary of the NPU stage graphs.

Every helper emits the op pattern the RK3588 compiler is known to map onto the NPU
(rknn-toolkit2 2.5.0's layer table, convert/README.md): MatMul against a constant weight
becomes a 1x1 Conv, RMSNorm spelled as Mul/ReduceMean/Add/Sqrt/Div/Mul fuses to exNorm,
``g*sigmoid(g)*u`` fuses to ConvExSwish + ConvMul. Exp is avoided (it falls back to the CPU).

Weights follow the Hugging Face convention (``[out, in]``) at the call site and are
stored transposed as ``[in, out]`` initializers, which is what MatMul wants. Graphs use
static shapes ``[1, T, D]``: RKNN's dynamic shapes are a fixed list anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # ReduceMean takes ``axes`` as an attribute up to opset 17; rknn accepts it
IR_VERSION = 8  # readable by onnx<=1.18 in the rknn-toolkit2 venv


EXTERNAL_MIN_BYTES = 1 << 20  # smaller initializers stay inside the .onnx
_EXTERNAL_ALIGN = 4096  # page-aligned, so onnxruntime can map the weights

_CLONABLE = frozenset({"Add", "Sub", "Mul", "Div", "Sigmoid"})


class GraphBuilder:
    """Accumulates nodes/initializers; each op returns the name of its output."""

    def __init__(self, name: str, weight_dtype: type = np.float32,
                 external_data: Path | None = None) -> None:
        """``external_data``: file (next to where the model will be saved) that receives
        every large initializer as it is added, so a vocabulary-sized lm_head is never held
        twice in memory nor copied by shape inference; created only when needed."""
        self.name = name
        self.weight_dtype = weight_dtype
        self.external_data = external_data
        self._ext_offset = 0
        self._nodes: list[onnx.NodeProto] = []
        self._inits: list[onnx.TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._used: set[str] = set()
        self._producer: dict[str, onnx.NodeProto] = {}
        self._counter = 0

    def _fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def _node(self, op: str, inputs: Sequence[str], hint: str, **attrs: Any) -> str:
        out = self._fresh(hint)
        node = helper.make_node(op, list(inputs), [out], name=out, **attrs)
        self._nodes.append(node)
        self._producer[out] = node
        return out

    # -- graph interface -------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int | str]) -> str:
        """A float32 graph input; a string dim is symbolic (ONNX twins of multi-shape
        graphs), rknn-toolkit2 then needs ``dynamic_input``."""
        self._claim(name)
        self._inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def output(self, value: str, name: str, shape: Sequence[int | str] | None = None) -> str:
        """Expose ``value`` as graph output ``name``.

        An elementwise result is recomputed by a clone of its node rather than passed
        through an Identity: rknn-toolkit2 2.5.0 crashes in ``build()`` (IndexError in
        ``_make_perm_consistent_for_tp``) under ``dynamic_input`` when the output of a
        residual Add is both a graph output and consumed further (found by the simulator
        tier with the attention-output stage). A cloned Add/Mul costs nothing on the NPU.
        """
        self._claim(name)
        producer = self._producer.get(value)
        if producer is not None and producer.op_type in _CLONABLE:
            clone = onnx.NodeProto()
            clone.CopyFrom(producer)
            clone.name = name
            del clone.output[:]
            clone.output.append(name)
            self._nodes.append(clone)
        elif value != name:
            self._nodes.append(helper.make_node("Identity", [value], [name], name=name))
        dims = list(shape) if shape is not None else None
        self._outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        return name

    def constant(self, name: str, array: np.ndarray) -> str:
        self._claim(name)
        if self.external_data is not None and array.nbytes >= EXTERNAL_MIN_BYTES:
            self._inits.append(self._external(name, array))
        else:
            self._inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def _external(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """Append ``array`` (any strides, e.g. a transposed view) in C order, a few MB at a
        time, and return the TensorProto pointing at it."""
        assert self.external_data is not None
        offset = -(-self._ext_offset // _EXTERNAL_ALIGN) * _EXTERNAL_ALIGN
        rows = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(1, -1)
        step = max(1, (1 << 22) // max(1, rows.shape[1] * array.itemsize))
        with open(self.external_data, "ab") as f:
            f.write(b"\0" * (offset - self._ext_offset))
            for start in range(0, rows.shape[0], step):
                f.write(np.ascontiguousarray(rows[start:start + step]).tobytes())
        self._ext_offset = offset + array.nbytes
        t = onnx.TensorProto(name=name, dims=list(array.shape),
                             data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                             data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self.external_data.name), ("offset", str(offset)),
                           ("length", str(array.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    def weight(self, name: str, array: np.ndarray) -> str:
        return self.constant(name, np.asarray(array, dtype=self.weight_dtype))

    def _claim(self, name: str) -> None:
        if name in self._used:
            raise ValueError(f"duplicate tensor name {name!r} in graph {self.name}")
        self._used.add(name)

    def build(self) -> onnx.ModelProto:
        graph = helper.make_graph(self._nodes, self.name, self._inputs, self._outputs,
                                  initializer=self._inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="ling3-rknn convert")
        model.ir_version = IR_VERSION
        # Outputs declared without a shape get the inferred one: rknn-toolkit2 and the
        # manifest both want every output's static shape.
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        for out in model.graph.output:
            if not out.type.tensor_type.HasField("shape"):
                raise ValueError(f"cannot infer the shape of output {out.name!r}")
        if self._ext_offset == 0:
            onnx.checker.check_model(model)
        # else: the checker resolves external data relative to the saved file; the caller
        # runs ``onnx.checker.check_model(path)`` after saving next to the data
        return model

    # -- ops ---------------------------------------------------------------------------
    def node(self, op: str, inputs: Sequence[str], hint: str | None = None, **attrs: object
             ) -> str:
        """Any single-output ONNX op (Reshape, Transpose, batched MatMul, Softplus...)."""
        return self._node(op, inputs, hint or op.lower(), **attrs)

    def reshape(self, x: str, shape: Sequence[int], name: str) -> str:
        """Reshape with ``0`` = keep that dim, so one graph serves every T."""
        return self._node("Reshape", [x, self.constant(name, np.array(shape, np.int64))],
                          "reshape")

    def add(self, a: str, b: str) -> str:
        return self._node("Add", [a, b], "add")

    def mul(self, a: str, b: str) -> str:
        return self._node("Mul", [a, b], "mul")

    def scale_shift(self, x: str, name: str, scale: np.ndarray | None = None,
                    shift: np.ndarray | None = None) -> str:
        """``x * scale + shift`` with constant (broadcast) operands, e.g. the KDA forget
        gate's ``dt_bias`` and per-head ``exp(A_log)``; folded by the compiler."""
        if scale is not None:
            x = self.mul(x, self.weight(name + ".scale", scale))
        if shift is not None:
            x = self.add(x, self.weight(name + ".shift", shift))
        return x

    def sigmoid(self, x: str) -> str:
        return self._node("Sigmoid", [x], "sigmoid")

    def silu(self, x: str) -> str:
        return self.mul(x, self.sigmoid(x))

    def linear(self, x: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None
               ) -> str:
        """``x @ weight.T (+ bias)`` with ``weight [out, in]`` (Hugging Face layout)."""
        w = self.weight(name + ".weight", np.asarray(weight).T)
        y = self._node("MatMul", [x, w], "matmul")
        if bias is not None:
            y = self.add(y, self.weight(name + ".bias", bias))
        return y

    def rmsnorm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, in the fusable form."""
        sq = self.mul(x, x)
        mean = self._node("ReduceMean", [sq], "reducemean", axes=[-1], keepdims=1)
        eps_c = self.constant(name + ".eps", np.array(eps, np.float32))
        root = self._node("Sqrt", [self.add(mean, eps_c)], "sqrt")
        normed = self._node("Div", [x, root], "div")
        return self.mul(normed, self.weight(name + ".weight", weight))

    def swiglu_mlp(self, x: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                   name: str) -> str:
        """``down(silu(gate(x)) * up(x))``: the shared expert and the dense FFN."""
        g = self.linear(x, gate, name + ".gate_proj")
        u = self.linear(x, up, name + ".up_proj")
        return self.linear(self.mul(self.silu(g), u), down, name + ".down_proj")


# -- numpy twins: the references the ONNX helpers are tested against ---------------------
def np_rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def np_silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def np_swiglu_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray
                  ) -> np.ndarray:
    return (np_silu(x @ gate.T) * (x @ up.T)) @ down.T

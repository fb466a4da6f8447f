"""Fewer, larger nodes for the ``--target cpu`` stage graphs (after ``cpu_quant``).

The stage graphs are written in the op vocabulary the RK3588 compiler fuses (``onnx_ops``):
RMSNorm as six elementwise nodes, one MatMul per projection, a cloned node per output. On
onnxruntime's CPU provider every node is a kernel launch, and with an intra-op pool every
MatMulNBits is a parallel section the pool's workers must be woken for (they never spin,
``ling3_rknn/cpu_threads.py``). A decoded token is 17 graph runs of 7-35 nodes; the
rewrites below take them to 7-16 nodes, each exact up to float32 rounding:

1. **Sibling MatMulNBits** reading the same input (a KDA input stage's q/k/v, forget,
   gate and beta projections; an MLA input stage's q_a, kv_a, k_rope and head gate; the
   shared expert's gate and up; the router next to them) become one MatMulNBits and a
   ``Split``. The blocks of MatMulNBits run along K, one row of blocks per output column,
   so stacking the packed weights and scales along N is exact (same bytes, same kernel).
2. **RMSNorm** (``Mul(x, x) -> ReduceMean -> Add(eps) -> Sqrt -> Div(x, .) -> Mul(., w)``)
   becomes one ``SimplifiedLayerNormalization`` (onnxruntime's fused RMSNorm kernel, the
   op its own optimizer fuses ``Pow``-spelled RMSNorm into; float32 statistics).
3. **Cloned elementwise nodes** (``onnx_ops.GraphBuilder.output`` recomputes an output
   instead of an Identity, for rknn-toolkit2) are computed once, **Identity** nodes in
   front of graph outputs are dropped (the producer writes the output directly), and a
   ``Split`` straight into a ``Concat`` of the same pieces (the lm_head, written in row
   blocks for the NPU and merged by 1.) goes.

Graph inputs and outputs keep their names and order (the stage contract reads outputs
by position). The ops are onnxruntime's (``com.microsoft`` MatMulNBits was already), so
these graphs are for onnxruntime only, which is what ``--target cpu`` runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

_DEDUPE = frozenset({"Add", "Sub", "Mul", "Div", "Sigmoid"})


def fuse_for_cpu(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite ``model`` in place (and return it); see the module docstring."""
    g = model.graph
    nodes = list(g.node)
    _dedupe(g, nodes)
    _rmsnorm(g, nodes)
    _merge_matmul_nbits(g, nodes)
    _drop_split_concat(g, nodes)
    _drop_output_identities(g, nodes)
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]  # names changed; onnxruntime infers shapes itself
    used = {i for n in nodes for i in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return model


def _rename_uses(nodes: list[onnx.NodeProto], old: str, new: str) -> None:
    for n in nodes:
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = new


def _consumers(nodes: list[onnx.NodeProto], name: str) -> list[onnx.NodeProto]:
    return [n for n in nodes if name in n.input]


def _dedupe(g: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    outputs = {o.name for o in g.output}
    seen: dict[tuple, onnx.NodeProto] = {}
    for n in list(nodes):
        if n.op_type not in _DEDUPE or n.domain or n.attribute or len(n.output) != 1:
            continue
        key = (n.op_type, tuple(n.input))
        keep = seen.get(key)
        if keep is None:
            seen[key] = n
            continue
        old, new = keep.output[0], n.output[0]
        if old in outputs and new in outputs:
            continue  # two graph outputs of the same value: leave both
        if new in outputs:  # the kept node produces the graph output's name
            keep.output[0] = new
            _rename_uses(nodes, old, new)
        else:
            _rename_uses(nodes, new, old)
        nodes.remove(n)


def _rmsnorm(g: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    inits = {t.name: t for t in g.initializer}
    outputs = {o.name for o in g.output}

    def only(name: str, op: str) -> onnx.NodeProto | None:
        if name in outputs:
            return None
        c = _consumers(nodes, name)
        return c[0] if len(c) == 1 and c[0].op_type == op and not c[0].domain else None

    for sq in list(nodes):
        if sq.op_type != "Mul" or sq.domain or sq.input[0] != sq.input[1]:
            continue
        x = sq.input[0]
        mean = only(sq.output[0], "ReduceMean")
        if mean is None or any(a.name == "keepdims" and a.i == 0 for a in mean.attribute):
            continue
        axes = [list(a.ints) for a in mean.attribute if a.name == "axes"]
        if axes != [[-1]] or len(mean.input) != 1:
            continue
        add = only(mean.output[0], "Add")
        if add is None:
            continue
        eps_name = add.input[1] if add.input[0] == mean.output[0] else add.input[0]
        sqrt = only(add.output[0], "Sqrt")
        if sqrt is None:
            continue
        div = only(sqrt.output[0], "Div")
        if eps_name not in inits or div is None or list(div.input) != [x, sqrt.output[0]]:
            continue
        mul = only(div.output[0], "Mul")
        if mul is None:
            continue
        w_name = mul.input[1] if mul.input[0] == div.output[0] else mul.input[0]
        eps = numpy_helper.to_array(inits[eps_name])
        if w_name not in inits or eps.size != 1 or len(inits[w_name].dims) != 1:
            continue
        fused = helper.make_node("SimplifiedLayerNormalization", [x, w_name], [mul.output[0]],
                                 name=mul.output[0] + "_rmsnorm", axis=-1,
                                 epsilon=float(eps.reshape(-1)[0]), stash_type=1)
        at = nodes.index(sq)
        for n in (sq, mean, add, sqrt, div, mul):
            nodes.remove(n)
        nodes.insert(at, fused)


def _attrs(n: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _merge_matmul_nbits(g: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    inits = {t.name: t for t in g.initializer}
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for n in nodes:
        # A, packed B, scales only: no zero points, g_idx or bias to stack
        if n.op_type != "MatMulNBits" or len(n.input) != 3 or n.input[1] not in inits \
                or n.input[2] not in inits:
            continue
        a = _attrs(n)
        groups[(n.input[0], a["K"], a["bits"], a["block_size"], a.get("accuracy_level", 0))
               ].append(n)
    for group in groups.values():
        if len(group) < 2:
            continue
        packed = [numpy_helper.to_array(inits[n.input[1]]) for n in group]
        scales = [numpy_helper.to_array(inits[n.input[2]]) for n in group]
        widths = [int(_attrs(n)["N"]) for n in group]
        if any(p.shape[0] != w for p, w in zip(packed, widths, strict=True)):
            continue  # not the [N, K / block, block bytes] layout: leave the group alone
        head = group[0]
        w_name, s_name = head.input[1] + "_fused", head.input[2] + "_fused"
        split_name, out = head.output[0] + "_split_sizes", head.output[0] + "_fused"
        g.initializer.extend([
            numpy_helper.from_array(np.concatenate(packed), w_name),
            numpy_helper.from_array(np.concatenate([s.reshape(w, -1) for s, w in
                                                    zip(scales, widths, strict=True)]
                                                   ).reshape(-1 if scales[0].ndim == 1 else
                                                             (sum(widths), -1)), s_name),
            numpy_helper.from_array(np.array(widths, np.int64), split_name),
        ])
        attrs = _attrs(head)
        attrs["N"] = sum(widths)
        fused = helper.make_node("MatMulNBits", [head.input[0], w_name, s_name], [out],
                                 name=out, domain=head.domain, **attrs)
        split = helper.make_node("Split", [out, split_name], [n.output[0] for n in group],
                                 name=out + "_split", axis=-1)
        at = min(nodes.index(n) for n in group)
        for n in group:
            nodes.remove(n)
        nodes[at:at] = [fused, split]


def _drop_split_concat(g: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """A ``Split`` whose pieces only feed one ``Concat`` on the same axis, in order, undoes
    itself (the lm_head written in row blocks for the NPU, merged back above)."""
    outputs = {o.name for o in g.output}
    for split in [n for n in nodes if n.op_type == "Split" and not n.domain]:
        pieces = list(split.output)
        users = {id(n): n for p in pieces for n in _consumers(nodes, p)}
        if len(users) != 1 or any(p in outputs for p in pieces):
            continue
        (concat,) = users.values()
        if concat.op_type != "Concat" or concat.domain or list(concat.input) != pieces:
            continue
        if _attrs(split).get("axis") != -1 or _attrs(concat).get("axis") not in (-1, 2):
            continue  # stage tensors are [1, T, width]: the last axis is 2
        source = split.input[0]
        producer = next((p for p in nodes if source in p.output), None)
        if producer is None or len(_consumers(nodes, source)) != 1:
            continue
        producer.output[list(producer.output).index(source)] = concat.output[0]
        nodes.remove(split)
        nodes.remove(concat)


def _drop_output_identities(g: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    outputs = {o.name for o in g.output}
    inputs = {i.name for i in g.input} | {t.name for t in g.initializer}
    for n in list(nodes):
        if n.op_type != "Identity" or n.domain or n.output[0] not in outputs:
            continue
        src, dst = n.input[0], n.output[0]
        producer = next((p for p in nodes if src in p.output), None)
        if producer is None or src in outputs or src in inputs:
            continue
        producer.output[list(producer.output).index(src)] = dst
        nodes.remove(n)
        _rename_uses(nodes, src, dst)

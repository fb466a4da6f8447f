"""One stage into the bundle: its float graph, the ONNX twin and (rk3588) the ``.rknn``."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from convert.calibration import CalibrationData
from convert.options import (
    CPU_QUANT_ACCURACY_LEVEL,
    CPU_QUANT_BLOCK,
    ConvertError,
    ConvertOptions,
    stage_quant,
)
from convert.stage_graphs import (
    StageGraph,
    final_graph,
    kda_input_graph,
    kda_output_graph,
    mla_input_graph,
    mla_output_graph,
)
from ling3_rknn.bundle import PLACEHOLDER_MAGIC, BundleWriter, StageName, StageSpec
from ling3_rknn.model.weights import CheckpointWeights

log = logging.getLogger("convert.converter")


def build_stage(w: CheckpointWeights, name: str, wdtype: type,
                external: Path | None = None) -> StageGraph:
    """The float graph of dense stage ``name`` (``layer.N.in|out`` or ``final``)."""
    cfg = w.cfg
    stage = StageName.parse(name)
    if stage.role == "final":
        return final_graph(name, w.final(), cfg, wdtype, external)
    assert stage.layer is not None
    i = stage.layer
    kda = cfg.layer_kinds[i] == "kda"
    if stage.role == "in":
        return (kda_input_graph(name, w.kda_input(i), cfg, wdtype, external) if kda
                else mla_input_graph(name, w.mla_input(i), cfg, wdtype, external))
    out = w.output(i)
    return (kda_output_graph(name, out, cfg, wdtype, external) if kda
            else mla_output_graph(name, out, cfg, wdtype, external))


def _weight_count(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT)


GraphFactory = Callable[[Path | None], StageGraph]


class StageWriter:
    """Writes one stage: the ONNX twin (QDQ for w8a8) and, for rk3588, its ``.rknn``.

    Large weights go to ``<stage>.onnx.data`` as the graph is built (GraphBuilder's
    external data), so peak memory stays near one copy of the largest weight.
    """

    def __init__(self, writer: BundleWriter, opts: ConvertOptions,
                 calib: CalibrationData | None) -> None:
        self.writer, self.opts, self.calib = writer, opts, calib
        self.quant = stage_quant(opts)
        # stages whose twin is derived from an fp32 source graph built aside
        self.derived = self.quant in ("w8a8", "int8", "int4")

    def write(self, name: str, build: GraphFactory) -> StageSpec:
        o, rel = self.opts, f"stages/{name}"
        onnx_rel, rknn_rel = rel + ".onnx", (None if o.target == "cpu" else rel + ".rknn")
        done = self.writer.done(onnx_rel) and (rknn_rel is None or self.writer.done(rknn_rel))
        # the twin of a w8a8 stage is derived; the fp32 source graph is built aside
        src_dir = "build" if (self.derived or done) else "stages"
        src = self.writer.path(f"{src_dir}/{name}.onnx")
        data = src.with_name(src.name + ".data")
        data.unlink(missing_ok=True)
        graph = build(data)
        chunk_sets = graph.shape_sets(o.chunk_sizes)
        per_weight = {"fp32": 4, "fp16": 2, "w8a8": 1, "int8": 1.125, "int4": 0.625}[
            self.quant]
        quantization: dict[str, str | float | None] | None = None
        if self.quant in ("int8", "int4"):
            quantization = {"op": "MatMulNBits", "block_size": CPU_QUANT_BLOCK,
                            "accuracy_level": CPU_QUANT_ACCURACY_LEVEL}
        if self.quant == "w8a8":
            quantization = {"algorithm": o.w8a8_algorithm, "hybrid_cos": o.w8a8_hybrid_cos,
                            "calibration_samples": o.calibration_samples}
        nbytes = int(_weight_count(graph.model) * per_weight)
        try:
            if not done:
                onnx.save(graph.model, str(src))
                onnx.checker.check_model(str(src))
                self._write_rknn(graph, src, rknn_rel, chunk_sets, name)
                self._write_twin(graph, src, onnx_rel, name)
        finally:
            if src_dir == "build":
                src.unlink(missing_ok=True)
                data.unlink(missing_ok=True)
        if rknn_rel is not None and o.build_rknn:
            nbytes = self.writer.path(rknn_rel).stat().st_size
        return StageSpec(name=name, onnx=onnx_rel, rknn=rknn_rel, quant=self.quant,
                         inputs=tuple(graph.inputs), outputs=tuple(graph.outputs),
                         shape_sets=tuple(tuple(tuple(s) for s in g) for g in chunk_sets),
                         input_dtype="float32", nbytes=nbytes, quantization=quantization)

    def _samples(self, name: str, inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        if self.calib is None:
            raise ConvertError("w8a8 needs calibration samples")
        stage, count = StageName.parse(name), self.opts.calibration_samples
        if stage.role == "expert":
            assert stage.layer is not None and stage.expert is not None
            return self.calib.expert_samples(stage.layer, stage.expert, count)
        return self.calib.samples(name, inputs, count)

    def _write_rknn(self, graph: StageGraph, src: Path, rknn_rel: str | None,
                    shape_sets: Any, name: str) -> None:
        if rknn_rel is None:
            return
        path = self.writer.path(rknn_rel)
        if not self.opts.build_rknn:
            digest = hashlib.sha256(graph.model.SerializeToString()).hexdigest()
            path.write_bytes(PLACEHOLDER_MAGIC + f"{name} {self.quant} onnx-sha256 "
                             f"{digest}\n".encode())
            self.writer.record(rknn_rel)
            return
        from convert.rknn_toolkit import build_rknn

        result = build_rknn(src, path, self.quant,
                            calibration=(self._samples(name, graph.inputs)
                                         if self.quant == "w8a8" else None),
                            dynamic_input=shape_sets, algorithm=self.opts.w8a8_algorithm,
                            hybrid_cos=(self.opts.w8a8_hybrid_cos
                                        if self.quant == "w8a8" else None))
        if result.cpu_ops:
            log.warning("%s: ops left on the board CPU: %s", name, ", ".join(result.cpu_ops))
        self.writer.record(rknn_rel)

    def _write_twin(self, graph: StageGraph, src: Path, onnx_rel: str, name: str) -> None:
        # fp16/fp32: the twin is the very graph the .rknn was compiled from (README: the
        # mocked NPU).
        # w8a8: the same graph with the int8 quantization simulated, so host runs show
        # its error.
        if self.quant == "w8a8":
            from convert.w8a8_twin import quantize_twin

            model = quantize_twin(src, self._samples(name, graph.inputs))
            self.writer.write_bytes(onnx_rel, model.SerializeToString())
            return
        if self.quant in ("int8", "int4"):
            from convert.cpu_quant import quantize_matmuls

            model = quantize_matmuls(src, bits=8 if self.quant == "int8" else 4,
                                     block_size=CPU_QUANT_BLOCK,
                                     accuracy_level=CPU_QUANT_ACCURACY_LEVEL)
            self.writer.write_bytes(onnx_rel, model.SerializeToString())
            return
        data = src.with_name(src.name + ".data")
        if data.is_file():
            self.writer.record(onnx_rel + ".data")
        self.writer.record(onnx_rel)

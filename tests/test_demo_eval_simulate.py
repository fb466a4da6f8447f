"""``evaluate --simulate`` rebuilds each stage of a bundle in rknn-toolkit2's simulator the
way the converter built it: the toolkit settings recorded in the manifest (algorithm,
auto-hybrid threshold) reach the simulator, not its defaults (an mmse bundle was once
replayed as a ``normal`` one). The simulator process is replaced by a recorder; the real
one runs in the ``simulator`` tier."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from pathlib import Path
from typing import ClassVar

import convert.rknn_simulator as rknn_simulator
from convert.demo_model.evaluate import simulate_stages
from ling3_rknn.bundle import Bundle

DEMO = Path(__file__).parents[1] / "convert" / "demo_model"
BUNDLE = Path(__file__).parents[1] / "ling3_rknn" / "demo" / "bundle"


class RecordingGraphs:
    """Stands in for ``SimulatedGraphs``: keeps the jobs, builds nothing."""

    seen: ClassVar[list] = []

    def __init__(self, jobs) -> None:
        RecordingGraphs.seen = list(jobs)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def executors(self) -> dict:
        return {"replaced": True}


def test_simulate_rebuilds_stages_with_the_recorded_quantization(tmp_path, monkeypatch):
    manifest = Bundle.open(BUNDLE).manifest
    recorded = {"algorithm": "kl_divergence", "hybrid_cos": 0.97, "calibration_samples": 3}
    stages = {name: dataclasses.replace(spec, quant="w8a8", quantization=recorded)
              for name, spec in manifest.stages.items()}
    replaced: list = []
    model = types.SimpleNamespace(
        bundle=types.SimpleNamespace(manifest=types.SimpleNamespace(
            stages=stages, chunk_sizes=manifest.chunk_sizes)),
        stages=types.SimpleNamespace(replace_executors=replaced.append))
    monkeypatch.setattr(rknn_simulator, "SimulatedGraphs", RecordingGraphs)
    with contextlib.ExitStack() as stack:
        simulate_stages(model, DEMO / "checkpoint", DEMO / "calibration.jsonl", tmp_path, stack)
    jobs = RecordingGraphs.seen
    assert {j.spec.name for j in jobs} == set(stages)
    assert {(j.algorithm, j.hybrid_cos) for j in jobs} == {("kl_divergence", 0.97)}
    # w8a8: calibrated from the prompts with the recorded sample count, chunk-long rows
    for job in jobs:
        for array in job.calibration.values():
            assert array.shape[0] == 3 and array.shape[2] == manifest.chunk_sizes[0], array.shape
    assert replaced == [{"replaced": True}]

"""Two prefill pieces in flight (ling3_rknn/model/pipeline.py): the same bits as one call
per piece, and a failure in either piece stops both and leaves the state broken."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import ORACLE_DIR, ORACLE_FIXTURES
from npu_matmul_double import DoubleRuntime

from ling3_rknn.model import Model, StateError
from ling3_rknn.model import model as model_module
from ling3_rknn.model.mla_npu import NpuAttention, NpuAttentionShapes
from ling3_rknn.model.pipeline import run_wavefront


def _models(fixture: str, npu: bool) -> tuple[Model, Model]:
    """A pipelined model and the same weights evaluated one piece per call."""
    base = Model.from_hf(ORACLE_DIR / fixture)
    c = base.config

    def make() -> Model:
        attention = None
        if npu:
            shapes = NpuAttentionShapes.of(c, query_rows=16, piece_rows=32)
            attention = NpuAttention(DoubleRuntime(), shapes)
        return Model(c, base.stages, base.experts, base.cpu, threads=2,
                     npu_attention=attention)

    piped, plain = make(), make()
    piped.pipeline_piece = 16
    plain.pipeline_piece = 0
    return piped, plain


@pytest.mark.parametrize("npu", [False, True])
@pytest.mark.parametrize("fixture", ORACLE_FIXTURES[:2])
def test_pieces_in_flight_give_the_bits_of_one_call_per_piece(fixture, npu):
    with np.load(ORACLE_DIR / fixture / "reference.npz") as ref:
        ids = np.asarray(ref["input_ids"])
    piped, plain = _models(fixture, npu)
    s1, s2 = piped.new_state(), plain.new_state()
    got = piped.forward(ids[:75], s1)  # five pieces of 16 (the last 11)
    want = np.concatenate([plain.forward(ids[a:min(a + 16, 75)], s2) for a in range(0, 75, 16)])
    np.testing.assert_array_equal(got, want)
    # the states went the same way: the next call (another 2.x pieces) agrees too
    last = piped.forward(ids[75:120], s1, last_only=True)
    for a in range(75, 120, 16):
        want_last = plain.forward(ids[a:min(a + 16, 120)], s2, last_only=True)
    np.testing.assert_array_equal(last, want_last)
    assert s1.length == s2.length == 120


@pytest.mark.parametrize("t,halves", [(12, (6, 6)), (11, (6, 5)), (9, None)])
def test_a_call_within_one_piece_runs_as_two_halves_in_flight(t, halves, monkeypatch):
    """A later turn shorter than the pipeline's piece still overlaps its NPU and CPU work:
    two halves in flight, the bits of a call per half; below twice the smallest half, one
    piece (the halves' extra weight reads would cost more than the overlap gives)."""
    with np.load(ORACLE_DIR / ORACLE_FIXTURES[0] / "reference.npz") as ref:
        ids = np.asarray(ref["input_ids"])
    piped, plain = _models(ORACLE_FIXTURES[0], True)
    s1, s2 = piped.new_state(), plain.new_state()
    piped.forward(ids[:16], s1)  # one piece: 16 < 2 x 192
    plain.forward(ids[:16], s2)
    monkeypatch.setattr(model_module, "PIPELINE_MIN_PIECE", 5)
    runs = []
    real = model_module.run_wavefront
    monkeypatch.setattr(model_module, "run_wavefront",
                        lambda n, *a: runs.append(n) or real(n, *a))
    got = piped.forward(ids[16:16 + t], s1)
    if halves is None:
        assert runs == []
        want = plain.forward(ids[16:16 + t], s2)
    else:
        assert runs == [2]
        first = halves[0]
        want = np.concatenate([plain.forward(ids[16:16 + first], s2),
                               plain.forward(ids[16 + first:16 + t], s2)])
    np.testing.assert_array_equal(got, want)


def test_a_failing_piece_stops_both_and_breaks_the_state(monkeypatch):
    with np.load(ORACLE_DIR / ORACLE_FIXTURES[0] / "reference.npz") as ref:
        ids = np.asarray(ref["input_ids"])
    piped, _ = _models(ORACLE_FIXTURES[0], False)
    state = piped.new_state()
    calls = {"n": 0}
    real = piped._moe

    def flaky(i, out):
        calls["n"] += 1
        if calls["n"] == 9:  # deep inside the second or third piece
            raise RuntimeError("NPU gone")
        return real(i, out)

    monkeypatch.setattr(piped, "_moe", flaky)
    with pytest.raises(RuntimeError, match="NPU gone"):
        piped.forward(ids[:64], state)
    with pytest.raises(StateError):
        piped.forward(ids[:4], state)  # half-advanced: refused until restored


def test_the_wavefront_orders_pieces_per_layer():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def run(p, before, after):
        for i in range(4):
            before(i)
            with lock:
                seen.append((p, i))
            after(i)
        return np.array([p])

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        out, _overlap = run_wavefront(5, 4, run, pool)
    assert [int(o[0]) for o in out] == list(range(5))
    for p in range(1, 5):
        for i in range(4):
            assert seen.index((p - 1, i)) < seen.index((p, i))

"""The numpy forward pass against transformers 5.24.0 logits (tests/oracle/make_fixtures.py).

Every fixture is checked for: one whole-sequence call, prefill in uneven pieces, prefill +
token-by-token decode, snapshot/restore mid-sequence, the to_arrays/from_arrays round trip,
and greedy generation. Tolerance: two float32 evaluations of the same model apart by at
most ``fp_bounds.model_error`` (the rounding along a token's path, from the model's sizes
and the logits' magnitude; ~1e-3 here, measured 1e-5 to 2e-5). The
``kernel_widths`` fixture has the widths the compiled kernels take, so where they are built
it holds them (KDA chunks, the KDA decode step, MLA attention) to transformers as well.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from conftest import KERNEL_WIDTHS_FIXTURE, ORACLE_DIR, ORACLE_FIXTURES
from fp_bounds import model_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ling3_rknn.model import Model, StateSnapshot


def tol(model: Model, ref) -> float:
    return model_error(model.config, len(ref["input_ids"]), float(np.abs(ref["logits_full"]).max()))


@pytest.fixture(scope="module", params=(*ORACLE_FIXTURES, KERNEL_WIDTHS_FIXTURE))
def oracle(request):
    path = ORACLE_DIR / request.param
    with np.load(path / "reference.npz") as ref:
        data = {k: ref[k] for k in ref.files}
    assert str(data["transformers_version"]) == "5.24.0"
    return Model.from_hf(path), data


def run_pieces(model: Model, ids: np.ndarray, sizes: list[int]) -> np.ndarray:
    assert sum(sizes) == len(ids)
    state = model.new_state()
    out, pos = [], 0
    for n in sizes:
        out.append(model.forward(ids[pos : pos + n], state))
        pos += n
    assert state.length == len(ids)
    return np.concatenate(out)


def max_err(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and a.dtype == np.float32
    return float(np.abs(a - b).max())


def test_whole_sequence(oracle):
    model, ref = oracle
    state = model.new_state()
    logits = model.forward(ref["input_ids"], state)
    assert logits.shape == (len(ref["input_ids"]), model.config.vocab_size)
    assert max_err(logits, ref["logits_full"]) < tol(model, ref)
    # the reference is not trivially small: logits vary over several units
    assert np.abs(ref["logits_full"]).max() > 2.0


def test_prefill_in_uneven_pieces(oracle):
    model, ref = oracle
    # pieces shorter and longer than the 64-token KDA chunk and the chunked form's cut-overs
    # (16 tokens in numpy, 4 with the compiled kernel)
    sizes = [1, 37, 2, 64, 3, 4, 15, 16, 8]
    assert max_err(run_pieces(model, ref["input_ids"], sizes), ref["logits_full"]) < tol(model, ref)


def test_prefill_then_token_by_token(oracle):
    model, ref = oracle
    p = int(ref["prefill_len"])
    n = len(ref["input_ids"])
    logits = run_pieces(model, ref["input_ids"], [p] + [1] * (n - p))
    assert max_err(logits, ref["logits_incremental"]) < tol(model, ref)
    assert max_err(logits, ref["logits_full"]) < tol(model, ref)


def test_snapshot_restore_mid_sequence(oracle):
    model, ref = oracle
    ids = ref["input_ids"]
    state = model.new_state()
    model.forward(ids[:53], state)
    snap = state.snapshot()
    assert snap.length == 53 and snap.nbytes > 0
    model.forward(ids[53:120], state)  # run ahead, then rewind
    state.restore(snap)
    assert state.length == 53
    tail = np.concatenate([model.forward(ids[53:100], state), model.forward(ids[100:], state)])
    assert max_err(tail, ref["logits_full"][53:]) < tol(model, ref)
    # a brand-new state restored from the same snapshot gives the same numbers again
    other = model.new_state()
    other.restore(snap)
    assert max_err(model.forward(ids[53:], other), ref["logits_full"][53:]) < tol(model, ref)


def test_persistence_round_trip(oracle, tmp_path):
    model, ref = oracle
    ids = ref["input_ids"]
    state = model.new_state()
    model.forward(ids[:90], state)
    path = tmp_path / "snap.npz"
    np.savez(path, **state.snapshot().to_arrays())
    with np.load(path) as f:
        snap = StateSnapshot.from_arrays(model.config, {k: f[k] for k in f.files})
    fresh = model.new_state()
    fresh.restore(snap)
    assert max_err(model.forward(ids[90:], fresh), ref["logits_full"][90:]) < tol(model, ref)


def test_greedy_generation_matches(oracle):
    model, ref = oracle
    prompt, expected = ref["generate_prompt"], ref["generate_out"]
    state = model.new_state()
    logits = model.forward(prompt, state, last_only=True)
    tokens = list(prompt)
    while len(tokens) < len(expected):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward([tokens[-1]], state)
    assert tokens == expected.tolist()


def test_last_only_matches_full(oracle):
    model, ref = oracle
    last = model.forward(ref["input_ids"][:40], model.new_state(), last_only=True)
    assert last.shape == (1, model.config.vocab_size)
    assert max_err(last, ref["logits_full"][39:40]) < tol(model, ref)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cuts=st.lists(st.integers(1, 149), max_size=6, unique=True))
def test_any_split_gives_the_same_logits(cuts):
    model, ref = _first_oracle()
    bounds = [0, *sorted(cuts), len(ref["input_ids"])]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert max_err(run_pieces(model, ref["input_ids"], sizes), ref["logits_full"]) < tol(model, ref)


@functools.cache
def _first_oracle():
    path = ORACLE_DIR / ORACLE_FIXTURES[1]
    with np.load(path / "reference.npz") as ref:
        return Model.from_hf(path), {k: ref[k] for k in ref.files}

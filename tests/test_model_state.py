"""Sequence state: block-shared snapshots, independent branches, persistence validation,
input validation and the half-updated-state guard."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE_DIR
from fp_bounds import model_error

from ling3_rknn.model import Model, SnapshotError, StateError, StateSnapshot
from ling3_rknn.model.state import BLOCK_TOKENS

RNG = np.random.default_rng(7)
LONG = RNG.integers(0, 256, size=700)  # crosses two latent blocks


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Model:
    return Model.from_hf(tiny_model_dir)


def test_branches_from_one_snapshot_do_not_disturb_each_other(model):
    prefix = LONG[:300]  # one full (frozen) block + a partial one
    state = model.new_state()
    model.forward(prefix, state)
    snap = state.snapshot()
    frozen_before = [b.copy() for s in snap._latents.values() for b in s.frozen]
    a_ids, b_ids = LONG[300:520], RNG.integers(0, 256, size=220)

    def branch(ids):
        s = model.new_state()
        s.restore(snap)
        return model.forward(ids, s)

    a1 = branch(a_ids)
    b1 = branch(b_ids)  # fills the same partial block with other tokens
    a2 = branch(a_ids)
    np.testing.assert_array_equal(a1, a2)
    # the frozen blocks the snapshot shares were never written
    after = [b for s in snap._latents.values() for b in s.frozen]
    for x, y in zip(frozen_before, after, strict=True):
        np.testing.assert_array_equal(x, y)
        assert not y.flags.writeable
    # and the branches equal uninterrupted runs
    ref = model.forward(np.concatenate([prefix, b_ids]), model.new_state())
    # against one uninterrupted call: two float32 evaluations (fp_bounds.py)
    np.testing.assert_allclose(b1, ref[300:], rtol=0, atol=model_error(
        model.config, 520, float(np.abs(ref).max())))


def test_snapshot_shares_full_blocks_and_copies_the_tail(model):
    state = model.new_state()
    model.forward(LONG[:600], state)
    s1 = state.snapshot()
    model.forward(LONG[600:610], state)
    s2 = state.snapshot()
    for layer in state.layout.mla_layers:
        f1, f2 = s1._latents[layer].frozen, s2._latents[layer].frozen
        assert len(f1) == 600 // BLOCK_TOKENS
        assert all(a is b for a, b in zip(f1, f2, strict=True))  # shared, not copied
    per_token = 4 * model.config.latent_dim * len(state.layout.mla_layers)
    assert s2.nbytes - s1.nbytes == 10 * per_token
    assert s1.private_nbytes < s1.nbytes
    kda = sum(
        4 * (np.prod(state.layout.conv_shape) + np.prod(state.layout.recurrent_shape))
        for _ in state.layout.kda_layers
    )
    assert s1.private_nbytes == kda + (600 % BLOCK_TOKENS) * per_token
    shared = s1.shared_blocks()
    assert len(shared) == (600 // BLOCK_TOKENS) * len(state.layout.mla_layers)
    assert {id(b) for b in shared} == {id(b) for b in s2.shared_blocks()}
    assert s1.nbytes == s1.private_nbytes + sum(b.nbytes for b in shared)
    assert s1.length == 600 and s2.length == 610


def test_snapshot_is_independent_of_later_updates(model):
    state = model.new_state()
    model.forward(LONG[:20], state)
    snap = state.snapshot()
    arrays = {k: v.copy() for k, v in snap.to_arrays().items()}
    model.forward(LONG[20:40], state)
    for k, v in snap.to_arrays().items():
        np.testing.assert_array_equal(v, arrays[k])


def test_persistence_round_trip_is_exact(model):
    state = model.new_state()
    model.forward(LONG[:280], state)
    snap = state.snapshot()
    back = StateSnapshot.from_arrays(model.config, snap.to_arrays())
    assert back.length == 280 and back.nbytes == snap.nbytes
    a, b = model.new_state(), model.new_state()
    a.restore(snap)
    b.restore(back)
    np.testing.assert_array_equal(model.forward(LONG[280:300], a), model.forward(LONG[280:300], b))


def good_arrays(model):
    state = model.new_state()
    model.forward(LONG[:10], state)
    return state.snapshot().to_arrays()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.pop("kda.0.recurrent"), "missing"),
        (lambda a: a.update({"bogus": np.zeros(1)}), "unexpected"),
        (lambda a: a.update({"kda.0.conv": a["kda.0.conv"][:, :-1]}), "kda.0.conv"),
        (
            lambda a: a.update({"kda.1.recurrent": a["kda.1.recurrent"].astype(np.float64)}),
            "float32",
        ),
        (lambda a: a.update({"mla.3.latent": a["mla.3.latent"][:-1]}), "mla.3.latent"),
        (lambda a: a.update({"length": np.array(-1)}), "length"),
        (lambda a: a.update({"length": np.array([10])}), "length"),
        (lambda a: a.update({"length": np.array(10.0)}), "length"),
        (lambda a: a["kda.2.recurrent"].__setitem__((0, 0, 0), np.nan), "NaN"),
    ],
)
def test_from_arrays_rejects_bad_input(model, mutate, match):
    arrays = good_arrays(model)
    mutate(arrays)
    with pytest.raises(SnapshotError, match=match):
        StateSnapshot.from_arrays(model.config, arrays)


def test_restore_rejects_a_snapshot_of_another_model(model):
    other = Model.from_hf(ORACLE_DIR / "lora_hfmodule_bf16")  # different layer layout
    snap = other.new_state().snapshot()
    with pytest.raises(SnapshotError):
        model.new_state().restore(snap)
    with pytest.raises(ValueError, match="layout"):
        model.forward([1], other.new_state())


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "empty"),
        ([3, 256], "256"),
        ([-1], "-1"),
        (np.array([1.0, 2.0]), "integers"),
        ([[1, 2]], "flat"),
    ],
)
def test_bad_token_ids_leave_the_state_alone(model, ids, match):
    state = model.new_state()
    model.forward([5, 6], state)
    before = state.snapshot().to_arrays()
    with pytest.raises(ValueError, match=match):
        model.forward(ids, state)
    assert state.length == 2
    for k, v in state.snapshot().to_arrays().items():
        np.testing.assert_array_equal(v, before[k])


def test_context_limit(model):
    state = model.new_state()
    state.length = model.config.max_position_embeddings - 1
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.forward([1, 2], state)


def test_failed_forward_marks_the_state_until_restore(model, monkeypatch):
    state = model.new_state()
    model.forward(LONG[:5], state)
    snap = state.snapshot()

    def boom(*args, **kwargs):
        raise RuntimeError("NPU fault")

    monkeypatch.setattr(model.stages, "mla_output", boom)
    with pytest.raises(RuntimeError, match="NPU fault"):
        model.forward(LONG[5:9], state)
    monkeypatch.undo()
    with pytest.raises(StateError):
        model.forward(LONG[5:9], state)
    state.restore(snap)
    expect = model.forward(LONG[:9], model.new_state())[5:]
    np.testing.assert_allclose(model.forward(LONG[5:9], state), expect, rtol=0,
                               atol=model_error(model.config, 9, float(np.abs(expect).max())))

"""The float16 MLA latent cache (``--latent-cache float16``): half the memory, the same
model up to one rounding of each cached value.

Against the float32 model on the oracle checkpoints (whose own float32 logits match
transformers to 1e-4): the logits move by far less than the logits' spread, decoding
token by token gives what one whole-sequence call gives, snapshots restore and persist in
their own dtype only, and the compiled kernel reads float16 blocks like the numpy path.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE_DIR, ORACLE_FIXTURES
from fp_bounds import U16, max_abs, mla_error, model_error

from ling3_rknn.engine.engine import Engine
from ling3_rknn.engine.options import EngineOptions
from ling3_rknn.model import Model, SnapshotError, StateSnapshot, mla, native
from ling3_rknn.model.state import SequenceState


@pytest.fixture(scope="module")
def models():
    path = ORACLE_DIR / ORACLE_FIXTURES[0]
    with np.load(path / "reference.npz") as ref:
        ids = np.asarray(ref["input_ids"])
    return Model.from_hf(path), Model.from_hf(path, latent_dtype="float16"), ids


def test_the_cache_is_float16_and_half_the_bytes(models):
    full, half, ids = models
    s32, s16 = full.new_state(), half.new_state()
    full.forward(ids, s32)
    half.forward(ids, s16)
    first = full.config.mla_layers[0]
    for i in full.config.mla_layers:
        blocks16, blocks32 = s16.latents[i].blocks(), s32.latents[i].blocks()
        assert all(b.dtype == np.float16 for b in blocks16)
        assert sum(b.nbytes for b in blocks16) * 2 == sum(b.nbytes for b in blocks32)
        rows16, rows32 = np.concatenate(blocks16), np.concatenate(blocks32)
        if i == first:  # one rounding of the same rows; later layers see a moved input
            np.testing.assert_array_equal(rows16, rows32.astype(np.float16))


def test_logits_stay_close_to_the_float32_model(models):
    full, half, ids = models
    want = full.forward(ids, full.new_state())
    got = half.forward(ids, half.new_state())
    spread = float(np.abs(want).max())
    assert spread > 2.0
    # each cached value rounded once to float16 (2^-11 relative) moves an MLA layer's
    # output by up to 2^-11 of it through the values and as much through the scores'
    # weights; to first order the logits by that fraction of their size per MLA layer, on
    # top of the two models' float32 rounding (measured 1e-4 to 4e-4 of the spread)
    mla_layers = len(full.config.mla_layers)
    bound = mla_layers * 2 * U16 * spread + model_error(full.config, len(ids), spread)
    assert max_abs(got, want) < bound
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() > 0.95


def test_token_by_token_equals_one_call(models):
    _, half, ids = models
    whole = half.forward(ids, half.new_state())
    state = half.new_state()
    half.forward(ids[:40], state)
    steps = [half.forward(ids[t : t + 1], state) for t in range(40, len(ids))]
    # both read the same float16 rows: only the float32 rounding of two splits differs
    assert max_abs(np.concatenate(steps), whole[40:]) < model_error(
        half.config, len(ids), float(np.abs(whole).max()))


def test_snapshots_persist_in_their_own_dtype(models, tmp_path):
    full, half, ids = models
    state = half.new_state()
    half.forward(ids[:90], state)
    arrays = state.snapshot().to_arrays()
    assert all(arrays[f"mla.{i}.latent"].dtype == np.float16 for i in half.config.mla_layers)
    path = tmp_path / "snap.npz"
    np.savez(path, **arrays)
    with np.load(path) as f:
        loaded = {k: f[k] for k in f.files}
    fresh = half.new_state()
    fresh.restore(half.snapshot_from_arrays(loaded))
    cold = half.new_state()
    half.forward(ids[:90], cold)
    # the same rows, the same folded KDA state (a prefill leaves nothing deferred): the
    # same arithmetic, bit for bit
    np.testing.assert_array_equal(half.forward(ids[90:], fresh), half.forward(ids[90:], cold))
    with pytest.raises(SnapshotError, match="expected float32"):
        full.snapshot_from_arrays(loaded)  # another model's snapshot, not converted
    with pytest.raises(SnapshotError, match="expected float16"):
        StateSnapshot.from_arrays(half.config, full_arrays(full, ids[:90]), "float16")
    with pytest.raises(SnapshotError, match="different layout"):
        half.new_state().restore(full_snapshot(full, ids[:10]))


def full_arrays(model: Model, ids: np.ndarray) -> dict[str, np.ndarray]:
    return full_snapshot(model, ids).to_arrays()


def full_snapshot(model: Model, ids: np.ndarray) -> StateSnapshot:
    state = model.new_state()
    model.forward(ids, state)
    return state.snapshot()


def test_an_unknown_dtype_is_refused(models):
    full, _, _ = models
    with pytest.raises(ValueError, match="latent cache dtype"):
        SequenceState(full.config, "bfloat16")
    with pytest.raises(ValueError, match="latent cache dtype"):
        Model.from_bundle("no-such-bundle", latent_dtype="int8")  # before any file is read


def test_prefix_cache_files_of_each_dtype_are_kept_apart(models, tmp_path):
    full, half, _ = models
    options = EngineOptions(model_id="x", max_context=64, cache_bytes=2**20, cache_dir=tmp_path,
                            weights_identity="weights:x")
    stores = [Engine._build_cache(m, options) for m in (full, half)]
    assert stores[0] is not None and stores[1] is not None
    assert stores[0]._disk.store.fingerprint != stores[1]._disk.store.fingerprint


@pytest.mark.skipif(not native.available(), reason="the compiled kernels are not built here")
@pytest.mark.usefixtures("kernel_march")  # each vector width (conftest.py)
@pytest.mark.parametrize("heads,r,rope", [(16, 512, 64), (2, 32, 16)])
def test_the_kernel_reads_float16_blocks_like_numpy(heads, r, rope):
    rng = np.random.default_rng(heads)
    blocks = [rng.standard_normal((n, r + rope)).astype(np.float16) for n in (256, 256, 31)]
    q_latent = rng.standard_normal((1, heads, r)).astype(np.float32)
    q_rope = rng.standard_normal((1, heads, rope)).astype(np.float32)
    got = mla.mla_attention(q_latent, q_rope, blocks, 543, 0.05)
    native.set_enabled(False)
    try:
        want = mla.mla_attention(q_latent, q_rope, blocks, 543, 0.05)
    finally:
        native.set_enabled(True)
    # float16 -> float32 is exact on both sides: two float32 attentions over the same rows
    assert max_abs(got, want) <= 2 * mla_error(q_latent, q_rope, blocks, 543, 0.05)


def test_blocks_past_the_first_256_rows_stay_float16(models):
    """Filling more than one 256-row block: every frozen block and the new tail are float16,
    in the live state and in a snapshot (the other tests never fill a block)."""
    from ling3_rknn.model.state import BLOCK_TOKENS

    full, half, _ = models
    ids = [int(t) for t in np.random.default_rng(0).integers(
        0, full.config.vocab_size, BLOCK_TOKENS + 40)]
    s16, s32 = half.new_state(), full.new_state()
    for chunk in range(0, len(ids), 64):  # chunked like a prefill
        half.forward(ids[chunk:chunk + 64], s16)
    full.forward(ids, s32)
    for i in full.config.mla_layers:
        blocks = s16.latents[i].blocks()
        assert len(blocks) == 2 and len(blocks[0]) == BLOCK_TOKENS
        assert [b.dtype for b in blocks] == [np.float16, np.float16]
        assert sum(b.nbytes for b in blocks) * 2 == sum(b.nbytes for b in s32.latents[i].blocks())
        snap = s16.latents[i].snapshot()
        assert snap.partial.dtype == np.float16 and snap.rows().dtype == np.float16

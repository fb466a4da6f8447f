"""The expanded MLA prefill form (ling3_rknn/model/mla_expanded.py) against the absorbed one.

The absorbed numpy attention is the reference (itself pinned to transformers by the oracle
tests, which run the expanded form too: ``Model.from_hf`` carries the bases). Here: the two
forms give the same attention output once W_vb is applied (the context may differ by a part
W_vb cannot see), the ski-rental choice between them, and the scratch's life cycle (kept
through decode and across a restore to a snapshot of the same history, dropped at any other
restore, capped in bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE_DIR, ORACLE_FIXTURES
from fp_bounds import U32, expanded_vs_absorbed_error, gamma, max_abs, model_error

from ling3_rknn.model import Model, mla, native
from ling3_rknn.model.mla_expanded import (
    ExpandedRows,
    PrefillScratch,
    expanded_attention,
    mla_bases,
)
from ling3_rknn.model.state import SequenceState

needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="the compiled attention kernel is not built here")


def _layer(rng: np.random.Generator, heads: int, r: int, dn: int, dv: int):
    w_kb = rng.standard_normal((heads, dn, r)).astype(np.float32) / np.sqrt(r)
    w_vb = rng.standard_normal((heads, dv, r)).astype(np.float32) / np.sqrt(r)
    return w_kb, w_vb


def _absorbed_output(q_lat, q_rope, latent, length, scale, w_vb):
    blocks = [latent[i:i + 256] for i in range(0, length, 256)]
    native.set_enabled(False)
    try:
        ctx = mla.mla_attention(q_lat, q_rope, blocks, length, scale)
    finally:
        native.set_enabled(True)
    return np.einsum("thr,hdr->thd", ctx, w_vb)


@needs_kernel
@pytest.mark.usefixtures("kernel_march")  # each vector width (conftest.py)
@pytest.mark.parametrize("heads,r,dn,dv,rope,length,t", [
    (16, 512, 128, 128, 64, 700, 64),  # Ling-3.0-tiny's MLA, a chunk at depth 636
    (8, 128, 32, 32, 16, 64, 64),      # the demo's, a first chunk
    (5, 24, 8, 12, 8, 300, 9),         # odd sizes: tiles with padding lanes
    (2, 16, 16, 16, 4, 40, 3),         # d_nope = r: the basis is all of the latent space
])
def test_expanded_output_matches_absorbed(heads, r, dn, dv, rope, length, t):
    rng = np.random.default_rng(heads * 100 + t)
    w_kb, w_vb = _layer(rng, heads, r, dn, dv)
    bases = mla_bases(w_kb, w_vb)
    latent = rng.standard_normal((length, r + rope)).astype(np.float32)
    q_nope = rng.standard_normal((t, heads, dn)).astype(np.float32)
    q_lat = np.einsum("thd,hdr->thr", q_nope, w_kb)  # what the input stage hands over
    q_rope = rng.standard_normal((t, heads, rope)).astype(np.float32)
    rows = ExpandedRows(bases, rope)
    rows.extend(latent[: length - t])  # a cached prefix, then the chunk's own rows
    rows.extend(latent[length - t:])
    ctx = expanded_attention(q_lat, q_rope, rows, length, 0.1)
    assert ctx is not None and ctx.shape == (t, heads, r)
    got = np.einsum("thr,hdr->thd", ctx, w_vb)
    want = _absorbed_output(q_lat, q_rope, latent, length, 0.1, w_vb)
    bound = expanded_vs_absorbed_error(q_lat, q_rope, latent, bases.key, bases.value, w_vb, 0.1)
    assert max_abs(got, want) <= bound


def test_bases_are_orthonormal_and_span_the_weights():
    rng = np.random.default_rng(0)
    w_kb, w_vb = _layer(rng, 4, 64, 16, 24)
    b = mla_bases(w_kb, w_vb)
    for basis, w in ((b.key, w_kb), (b.value, w_vb)):
        # orthonormal in float64, then rounded to float32 (u each entry): the Gram matrix's
        # r-term sums of unit columns' products are within gamma(r) + 2u of I
        gram = np.einsum("hrd,hre->hde", basis, basis)
        np.testing.assert_allclose(gram, np.broadcast_to(np.eye(basis.shape[2]), gram.shape),
                                   atol=gamma(64) + 2 * U32, rtol=0)
        projected = np.einsum("hdr,hrk,hsk->hds", w, basis, basis)  # W U U^T == W
        # two sums (r and d terms) and the bases' rounding, of |W||U||U^T|
        size = np.einsum("hdr,hrk,hsk->hds", np.abs(w), np.abs(basis), np.abs(basis))
        assert (np.abs(projected - w) <= (gamma(64) + gamma(basis.shape[2]) + 2 * U32) * size
                ).all()


def test_rows_are_projected_per_head_in_blocks():
    rng = np.random.default_rng(1)
    w_kb, w_vb = _layer(rng, 3, 32, 8, 8)
    b = mla_bases(w_kb, w_vb)
    latent = rng.standard_normal((300, 32 + 4)).astype(np.float32)
    rows = ExpandedRows(b, 4)
    rows.extend(latent[:250])
    rows.extend(latent[250:])  # crosses the first block's end
    assert rows.length == 300
    for head in range(3):
        got = np.concatenate(rows.head_blocks(head))[:300]
        for cols, basis in ((slice(0, 8), b.value[head]), (slice(8, 16), b.key[head])):
            _within_projection(got[:, cols], latent[:, :32] @ basis, latent[:, :32], basis)
        np.testing.assert_array_equal(got[:, 16:], latent[:, 32:])


def _within_projection(got, want, c, basis) -> None:
    """Two float32 projections of the same rows (GEMMs of other shapes may sum in another
    order): within two r-term sums' rounding of |c||basis|."""
    bound = 2 * gamma(c.shape[1]) * (np.abs(c) @ np.abs(basis))
    assert (np.abs(got - want) <= bound).all()


@pytest.mark.parametrize("keep", [0, 1, 255, 256, 257, 299])
def test_truncated_rows_extend_as_if_never_longer(keep):
    """A restore to an earlier point of the same history cuts the rows, at any offset in a
    block; the rows extended after it are those a fresh projection gives."""
    rng = np.random.default_rng(keep)
    w_kb, w_vb = _layer(rng, 3, 32, 8, 8)
    b = mla_bases(w_kb, w_vb)
    latent = rng.standard_normal((400, 32 + 4)).astype(np.float32)
    other = rng.standard_normal((300, 32 + 4)).astype(np.float32)
    rows = ExpandedRows(b, 4)
    rows.extend(other[:200])
    rows.extend(other[200:])
    rows.truncate(keep)
    assert rows.length == keep and len(rows.head_blocks(0)) == -(-keep // 256)
    rows.extend(np.concatenate([other[:keep], latent])[keep:keep + 400])
    fresh = ExpandedRows(b, 4)
    fresh.extend(np.concatenate([other[:keep], latent])[:keep + 400])
    assert rows.length == fresh.length == keep + 400
    seen = np.concatenate([other[:keep], latent])[:keep + 400, :32]
    for head in range(3):
        got = np.concatenate(rows.head_blocks(head))[:rows.length]
        want = np.concatenate(fresh.head_blocks(head))[:fresh.length]
        _within_projection(got[:, :16], want[:, :16], seen,
                           np.concatenate([b.value[head], b.key[head]], axis=1))
        np.testing.assert_array_equal(got[:, 16:], want[:, 16:])


class _Bases:
    """One layer's bases at Ling-3.0-tiny's size, shapes only (choose() reads shapes)."""

    key = np.zeros((16, 512, 128), np.float32)
    value = np.zeros((16, 512, 128), np.float32)

    @staticmethod
    def row_width(rope: int) -> int:
        return 256 + rope


@needs_kernel
def test_a_fresh_prompt_is_expanded_from_its_first_chunk():
    scratch = PrefillScratch()
    assert scratch.choose({3: _Bases()}, 64, 0, 64, 2 << 30)
    assert set(scratch.rows) == {3}


@needs_kernel
def test_a_continued_prefix_is_absorbed_until_the_projection_pays():
    """Ski rental: after a cached prefix of 16K rows the expanded form first needs every
    row projected (16K x 16 x 256 x 512 MACs); each absorbed 64-token chunk costs ~0.53 of
    that, so the second chunk buys (a 64-token turn never does)."""
    scratch = PrefillScratch()
    bases = {3: _Bases()}
    picks = []
    for k in range(4):
        length = 16384 + 64 * k
        picks.append(scratch.choose(bases, 64, length, 64, 2 << 30))
        if picks[-1]:  # the model projects what was bought (ExpandedRows.extend)
            scratch.rows[3].length = length + 64
    assert picks == [False, True, True, True]


@needs_kernel
def test_the_rent_outlasts_a_restore_of_the_same_history():
    """One-chunk turns after a prefix without rows: each turn's absorbed chunk adds to the
    rent, and a restore to the conversation's own snapshot keeps it, so the second turn
    buys the rows instead of every turn staying absorbed."""
    scratch = PrefillScratch()
    bases = {3: _Bases()}
    assert not scratch.choose(bases, 64, 16384, 64, 2 << 30)
    scratch.truncate(16384 + 64 + 8)  # the next turn resumes at the end of this one
    assert scratch.choose(bases, 64, 16384 + 72, 64, 2 << 30)
    assert scratch.absorbed_macs == 0  # spent on these rows
    scratch.release()
    assert not scratch.choose(bases, 64, 16384, 64, 2 << 30)  # dropped: a new rent


def test_one_token_never_takes_the_expanded_form():
    assert not PrefillScratch().choose({3: _Bases()}, 64, 0, 1, 2 << 30)


@needs_kernel
def test_rows_beyond_the_byte_cap_stay_absorbed():
    scratch = PrefillScratch()
    per_row = 16 * (256 + 64) * 4
    assert scratch.choose({3: _Bases()}, 64, 0, 64, 128 * per_row)
    assert not scratch.choose({3: _Bases()}, 64, 100, 64, 128 * per_row)
    assert not scratch.rows  # dropped, not left half-filled


@needs_kernel
def test_the_byte_cap_counts_this_calls_own_rows():
    """A fresh prompt costs nothing to project beforehand, so only the cap can refuse it:
    the prompt's own rows are counted, not just the cached ones (0 here)."""
    bases = {3: _Bases()}
    per_row = 16 * (256 + 64) * 4
    assert not PrefillScratch().choose(bases, 64, 0, 200, 128 * per_row)
    assert PrefillScratch().choose(bases, 64, 0, 128, 128 * per_row)  # exactly fits
    scratch = PrefillScratch()
    assert scratch.choose(bases, 64, 0, 64, 128 * per_row)
    scratch.rows[3].length = 64
    assert not scratch.choose(bases, 64, 64, 65, 128 * per_row)  # 64 cached + 65 > 128
    assert not scratch.rows


@needs_kernel
def test_rows_projected_with_other_bases_are_dropped():
    """Another model's bases (the same shapes): rows projected with the old ones would score
    against the wrong subspace, so they go and the rows not yet projected count again."""
    old, new = {3: _Bases()}, {3: _Bases()}
    scratch = PrefillScratch()
    assert scratch.choose(old, 64, 0, 64, 2 << 30)
    scratch.rows[3].length = 64
    # with the old rows kept, nothing would be left to project and the expanded form free;
    # dropped, 64 rows must be projected first, which one absorbed chunk does not pay for
    assert not scratch.choose(new, 64, 64, 64, 2 << 30)
    assert not scratch.rows
    assert scratch.choose(new, 64, 0, 64, 2 << 30)
    assert scratch.rows[3].bases is new[3]


# ---------------------------------------------------------------- through the model


@pytest.fixture(scope="module")
def oracle():
    path = ORACLE_DIR / ORACLE_FIXTURES[0]
    with np.load(path / "reference.npz") as ref:
        ids = np.asarray(ref["input_ids"])
    return Model.from_hf(path), ids


def _absorbed(model: Model, ids, pieces) -> np.ndarray:
    limit = model.prefill_scratch_bytes
    model.prefill_scratch_bytes = 0  # the expanded form never fits: absorbed throughout
    try:
        state = model.new_state()
        return np.concatenate([model.forward(ids[a:b], state) for a, b in pieces])
    finally:
        model.prefill_scratch_bytes = limit


def _pieces(n: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, pos, k = [], 0, 0
    while pos < n:
        end = min(n, pos + sizes[k % len(sizes)])
        out.append((pos, end))
        pos, k = end, k + 1
    return out


@needs_kernel
def test_model_prefill_in_pieces_matches_the_absorbed_form(oracle):
    model, ids = oracle
    assert model.cpu.mla_bases  # from_hf computes them
    pieces = _pieces(len(ids), [5, 1, 7, 2, 3])  # decoded rows projected by the next chunk
    state = model.new_state()
    got = np.concatenate([model.forward(ids[a:b], state) for a, b in pieces])
    want = _absorbed(model, ids, pieces)
    assert max_abs(got, want) < _model_tol(model, ids, want)


def _model_tol(model: Model, ids, want: np.ndarray) -> float:
    """Two float32 evaluations of the model (other forms, other splits): fp_bounds.py."""
    return model_error(model.config, len(ids), float(np.abs(want).max()))


@needs_kernel
def test_decode_keeps_the_rows_and_a_restore_of_the_same_history_keeps_its_prefix(oracle):
    model, ids = oracle
    first = model.config.mla_layers[0]
    state = model.new_state()
    model.forward(ids[:6], state)
    before = state.snapshot()
    model.forward(ids[6:7], state)  # decode tokens: absorbed, the rows stay
    model.forward(ids[7:8], state)
    assert state.prefill_scratch.rows[first].length == 6
    turn_end = state.snapshot()
    model.forward(ids[8:12], state)  # the decoded tokens' rows are projected first
    assert state.prefill_scratch.rows[first].length == 12
    # the next turn resumes at the end of this one: rows 0..8 still hold, 8..12 must go
    state.restore(turn_end)
    assert state.prefill_scratch.rows[first].length == 8
    other = ids[14:20][::-1]  # a different continuation: stale rows would show in the logits
    cont = model.forward(other, state)
    assert state.prefill_scratch.rows[first].length == 14
    cold = model.forward(np.concatenate([ids[:8], other]), model.new_state())[8:]
    assert max_abs(cont, cold) < _model_tol(model, ids, cold)
    # that restore began a new history: a snapshot from before it is no prefix of it now
    state.restore(before)
    assert not state.prefill_scratch.rows
    again = np.concatenate([model.forward(ids[6:10], state), model.forward(ids[10:14], state)])
    cold = model.forward(ids[:14], model.new_state())[6:]
    assert max_abs(again, cold) < _model_tol(model, ids, cold)


@needs_kernel
def test_kept_rows_over_a_float16_latent_cache(oracle):
    """Kept rows give, bit for bit, what the same pieces give never cut, over a float16
    cache, with a decode token's row projected later from the cache.

    Both runs see identical inputs: the same piece split (so each projection is one GEMM
    of the same shape over the same rows) and a restore at the same point, which folds the
    KDA state's deferred form (S = diag(c)(B + U D), kda.py) into one array in both. The
    run never restored would otherwise keep the deferred form and differ by its float32
    rounding, on any host: that, not the rows, moved the logits by 1.2e-5 on one ISA.
    The rows themselves are held to a fresh projection of the cache's float16 values
    within the rounding of an r-term float32 sum (fp_bounds.py); projected from the
    values before rounding they would be up to 2^-11 off, far outside it."""
    _, ids = oracle
    model = Model.from_hf(ORACLE_DIR / ORACLE_FIXTURES[0], latent_dtype="float16")
    first = model.config.mla_layers[0]
    other = ids[14:20][::-1]

    def run(cut: bool) -> tuple[np.ndarray, SequenceState]:
        state = model.new_state()
        model.forward(ids[:8], state)
        model.forward(ids[8:9], state)  # a decode token: its row is projected later
        model.forward(ids[9:11], state)
        turn_end = state.snapshot()
        if cut:  # run ahead, then back: the rows past the snapshot must go
            model.forward(ids[11:16], state)
            assert state.prefill_scratch.rows[first].length == 16
        state.restore(turn_end)
        assert state.prefill_scratch.rows[first].length == 11
        return model.forward(other, state), state

    (cont, cut_state), (want, _) = run(True), run(False)
    np.testing.assert_array_equal(cont, want)
    for i, rows in cut_state.prefill_scratch.rows.items():
        assert rows.length == 17
        cache = cut_state.latents[i].rows(0, 17)
        assert cache.dtype == np.float16
        fresh = ExpandedRows(rows.bases, model.config.qk_rope_head_dim)
        fresh.extend(cache)
        r = rows.bases.key.shape[1]
        c = np.abs(cache[:, :r].astype(np.float32))
        for head in range(rows.bases.heads):
            got = np.concatenate(rows.head_blocks(head))[:17]
            want_rows = np.concatenate(fresh.head_blocks(head))[:17]
            basis = np.abs(np.concatenate([rows.bases.value[head], rows.bases.key[head]], 1))
            bound = 2 * gamma(r) * (c @ basis)  # two r-term sums of |c||basis|, any order
            assert (np.abs(got[:, :basis.shape[1]] - want_rows[:, :basis.shape[1]])
                    <= bound).all()
            np.testing.assert_array_equal(got[:, basis.shape[1]:], want_rows[:, basis.shape[1]:])


@needs_kernel
def test_a_snapshot_from_elsewhere_drops_the_rows(oracle):
    model, ids = oracle
    state, other = model.new_state(), model.new_state()
    model.forward(ids[:8], state)
    model.forward(ids[:8], other)  # the same tokens, another history
    state.restore(other.snapshot())
    assert not state.prefill_scratch.rows
    model.forward(ids[:8], other)
    stored = model.snapshot_from_arrays(other.snapshot().to_arrays())  # as the disk tier reads
    other.restore(stored)
    assert not other.prefill_scratch.rows


@needs_kernel
def test_dropping_a_large_scratch_gives_the_pages_back(oracle, monkeypatch):
    from ling3_rknn.model import memory, mla_expanded

    model, ids = oracle
    trims = []
    monkeypatch.setattr(mla_expanded, "return_freed_memory", lambda: trims.append(1) or True)
    monkeypatch.setattr(mla_expanded, "TRIM_AFTER_BYTES", 1)
    state = model.new_state()
    model.forward(ids[:8], state)
    model.forward(ids[8:9], state)  # a decode token keeps the rows: nothing to give back
    assert trims == []
    state.restore(model.new_state().snapshot())  # another history: the rows go, one trim
    state.restore(model.new_state().snapshot())  # nothing left to drop: no second trim
    assert trims == [1]
    assert isinstance(memory.return_freed_memory(), bool)  # glibc: True; elsewhere False

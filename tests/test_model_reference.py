"""The plain reference model (ling3_rknn/model/reference.py) between transformers and the
fast path.

transformers 5.24.0 pins the reference through the committed oracle fixtures; the reference
then pins ``Model.from_hf`` on a sequence transformers never saw (longer than the fixtures,
past a 256-row latent-cache block, fed as uneven prefill pieces and then token by token).
Tolerance 1e-4 max abs, as in test_model_oracle.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import ORACLE_DIR, ORACLE_FIXTURES

from ling3_rknn.model import CheckpointError, Model
from ling3_rknn.model import model as model_module
from ling3_rknn.model.kda import kda_decode
from ling3_rknn.model.reference import ReferenceWeights, forward, greedy

TOL = 1e-4


@functools.cache
def _fixture(name: str) -> tuple[ReferenceWeights, dict[str, np.ndarray]]:
    path = ORACLE_DIR / name
    with np.load(path / "reference.npz") as ref:
        data = {k: ref[k] for k in ref.files}
    assert str(data["transformers_version"]) == "5.24.0"
    return ReferenceWeights(path), data


@pytest.mark.parametrize("name", ORACLE_FIXTURES)
def test_reference_matches_transformers(name):
    weights, ref = _fixture(name)
    logits = forward(weights, ref["input_ids"])
    assert logits.shape == ref["logits_full"].shape
    assert float(np.abs(logits - ref["logits_full"]).max()) < TOL
    assert np.abs(ref["logits_full"]).max() > 2.0  # not trivially small


@pytest.mark.parametrize("name", ORACLE_FIXTURES)
def test_reference_greedy_generation_matches_transformers(name):
    weights, ref = _fixture(name)
    prompt, expected = ref["generate_prompt"], ref["generate_out"]
    assert greedy(weights, prompt, len(expected) - len(prompt)) == expected.tolist()


def test_reference_is_causal():
    """Changing one token changes the later logits and never the earlier ones (causal)."""
    weights, ref = _fixture(ORACLE_FIXTURES[0])
    ids = ref["input_ids"][:40].copy()
    before = forward(weights, ids)
    ids[20] = (ids[20] + 1) % weights.config.vocab_size
    after = forward(weights, ids)
    assert np.array_equal(before[:20], after[:20])
    assert np.abs(before[20:] - after[20:]).max(axis=1).min() > 1e-6


@pytest.mark.parametrize("name", ORACLE_FIXTURES)
def test_fast_model_matches_reference_on_a_new_sequence(name):
    weights, _ = _fixture(name)
    ids = np.random.default_rng(27).integers(2, weights.config.vocab_size, 300)
    expected = forward(weights, ids)
    model = Model.from_hf(ORACLE_DIR / name)
    state = model.new_state()
    pieces = [130, 1, 64, 81]  # then 24 single decode tokens
    pieces += [1] * (len(ids) - sum(pieces))
    out, pos = [], 0
    for n in pieces:
        out.append(model.forward(ids[pos : pos + n], state))
        pos += n
    logits = np.concatenate(out)
    assert logits.dtype == np.float32
    assert float(np.abs(logits - expected).max()) < TOL


@pytest.mark.parametrize("split", [False, True])
def test_decode_with_kda_heads_split_over_threads_matches_reference(split, monkeypatch):
    """``Model.kda_decode_split`` (LING3_RKNN_KDA_DECODE_SPLIT) changes where a decode
    token's KDA heads run, never the logits."""
    pools = []

    def spy(*args, pool=None, **kwargs):
        pools.append(pool is not None)
        return kda_decode(*args, pool=pool, **kwargs)

    monkeypatch.setattr(model_module, "kda_decode", spy)
    name = ORACLE_FIXTURES[0]
    weights, ref = _fixture(name)
    ids = ref["input_ids"][:60]
    expected = forward(weights, ids)
    model = Model.from_hf(ORACLE_DIR / name)
    model.threads = 2  # a glue pool of one more thread, without re-pinning this process
    model.kda_decode_split = split
    state = model.new_state()
    logits = [model.forward(ids[:20], state)]
    logits += [model.forward(ids[i : i + 1], state) for i in range(20, len(ids))]
    assert float(np.abs(np.concatenate(logits) - expected).max()) < TOL
    assert pools and set(pools) == {split}  # every decode token took the path asked for


def test_kda_decode_split_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LING3_RKNN_KDA_DECODE_SPLIT", "1")
    assert Model.from_hf(ORACLE_DIR / ORACLE_FIXTURES[0]).kda_decode_split is True
    monkeypatch.delenv("LING3_RKNN_KDA_DECODE_SPLIT")
    assert Model.from_hf(ORACLE_DIR / ORACLE_FIXTURES[0]).kda_decode_split is False


def test_a_missing_tensor_is_named():
    weights, _ = _fixture(ORACLE_FIXTURES[0])
    with pytest.raises(CheckpointError, match=r"'model\.nope' or 'model\.neither'"):
        weights.get("model.nope", "model.neither")

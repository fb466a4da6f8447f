"""Sampler: every knob against a slow, obviously-correct full-sort reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ling3_rknn.engine.api import InvalidRequest, SamplingParams
from ling3_rknn.engine.sampler import (
    LING3_GENERATION_DEFAULTS,
    Sampler,
    SamplerSettings,
    defaults_from_generation_config,
    resolve_settings,
    top_k_ids,
)


def reference_distribution(x: np.ndarray, s: SamplerSettings) -> np.ndarray:
    """transformers' warper chain written with a full stable sort (test oracle only)."""
    z = x.astype(np.float64) / s.temperature
    order = np.lexsort((np.arange(x.size), -z))
    keep = np.zeros(x.size, bool)
    keep[order[: s.top_k] if s.top_k else order] = True
    z = np.where(keep, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1.0:
        ordered = p[order]
        exclusive = np.cumsum(ordered) - ordered
        drop = order[exclusive >= s.top_p]
        drop = drop[drop != order[0]]
        p[drop] = 0.0
    if s.min_p > 0.0:
        p[p < s.min_p * p.max()] = 0.0
    return p / p.sum()


def empirical(x: np.ndarray, s: SamplerSettings, n: int) -> np.ndarray:
    sampler = Sampler(s, x.size)
    counts = np.zeros(x.size)
    for _ in range(n):
        counts[sampler.sample(x)] += 1
    return counts / n


def test_greedy_picks_argmax_and_ties_go_to_lower_id():
    x = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert Sampler(SamplerSettings(temperature=0.0), 4).sample(x) == 1
    assert Sampler(SamplerSettings(top_k=1), 4).sample(x) == 1


def test_top_k_ids_orders_by_value_then_id_with_ties():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, size=5000).astype(np.float32)  # massive ties
    for k in (1, 7, 20, 300, 4999, 5000, 6000):
        got = top_k_ids(x, k)
        want = np.lexsort((np.arange(x.size), -x))[: min(k, x.size)]
        np.testing.assert_array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 2000),
    k=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_top_k_ids_matches_full_sort(n, k, seed):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    want = np.lexsort((np.arange(n), -x))[: min(k, n)]
    np.testing.assert_array_equal(top_k_ids(x, k), want)


@pytest.mark.parametrize(
    "s",
    [
        SamplerSettings(temperature=0.7, top_k=5),
        SamplerSettings(temperature=1.3, top_p=0.6),
        SamplerSettings(temperature=1.0, min_p=0.2),
        SamplerSettings(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05),
        SamplerSettings(temperature=2.0),
    ],
)
def test_sampled_distribution_matches_reference(s):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(300) * 2).astype(np.float32)
    want = reference_distribution(x, s)
    got = empirical(x, SamplerSettings(**{**s.__dict__, "seed": 3}), 20000)
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want))
    assert np.abs(got - want).max() < 0.02


def test_top_p_without_top_k_grows_candidates_on_flat_logits():
    x = np.zeros(5000, np.float32)  # 95% of mass needs 4750 candidates
    s = SamplerSettings(top_p=0.95, seed=0)
    sampler = Sampler(s, x.size)
    draws = {sampler.sample(x) for _ in range(3000)}
    assert max(draws) > 1000  # not stuck in the first guess of 64
    assert max(draws) < 4750  # the tail beyond the top-p set is never drawn


def test_seed_reproduces_and_different_seeds_differ():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    s = SamplerSettings(temperature=1.0, top_k=50, seed=1234)
    a = [Sampler(s, 1000).sample(x) for _ in range(1)]
    first = Sampler(s, 1000)
    second = Sampler(s, 1000)
    run1 = [first.sample(x) for _ in range(50)]
    run2 = [second.sample(x) for _ in range(50)]
    assert run1 == run2 and run1[0] == a[0]
    other = Sampler(SamplerSettings(temperature=1.0, top_k=50, seed=99), 1000)
    assert [other.sample(x) for _ in range(50)] != run1


def test_repetition_penalty_follows_transformers_rule():
    x = np.array([2.0, -2.0, 1.9, 0.0], np.float32)
    s = SamplerSettings(temperature=0.0, repetition_penalty=2.0)
    sampler = Sampler(s, 4, prompt_ids=[0])
    assert sampler.sample(x) == 2  # 2.0 / 2 = 1.0 < 1.9
    sampler.accept(2)  # now 1.9 / 2 = 0.95 < 1.0
    assert sampler.sample(x) == 0
    penalised = sampler._apply_penalties(x)
    np.testing.assert_allclose(penalised, [1.0, -2.0, 0.95, 0.0], rtol=1e-6)  # id 1 unseen
    np.testing.assert_array_equal(x, np.array([2.0, -2.0, 1.9, 0.0], np.float32))


def test_presence_and_frequency_penalties_use_output_counts_only():
    x = np.zeros(4, np.float32)
    s = SamplerSettings(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    sampler = Sampler(s, 4, prompt_ids=[3, 3, 3])
    for t in (1, 1, 2):
        sampler.accept(t)
    np.testing.assert_allclose(sampler._apply_penalties(x), [0.0, -1.0, -0.75, 0.0])


def test_non_finite_logits_raise():
    x = np.full(8, np.nan, np.float32)
    with pytest.raises(FloatingPointError):
        Sampler(SamplerSettings(temperature=0.0), 8).sample(x)
    with pytest.raises(FloatingPointError):
        Sampler(SamplerSettings(top_k=4, seed=0), 8).sample(x)


def test_resolve_merges_defaults_and_validates():
    s = resolve_settings(SamplingParams(top_k=5, seed=9), LING3_GENERATION_DEFAULTS)
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 0.95, 5, 9)
    assert resolve_settings(SamplingParams(top_k=-1), SamplingParams()).top_k == 0
    for bad in (
        SamplingParams(temperature=-1.0),
        SamplingParams(temperature=math.nan),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(min_p=2.0),
        SamplingParams(top_k=-5),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(presence_penalty=math.inf),
    ):
        with pytest.raises(InvalidRequest):
            resolve_settings(bad, LING3_GENERATION_DEFAULTS)


def test_defaults_from_generation_config():
    d = defaults_from_generation_config({"temperature": 0.6, "top_p": 0.9, "top_k": 40})
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.9, 40)
    assert defaults_from_generation_config({}).top_k == 20
    assert defaults_from_generation_config({"do_sample": False}).temperature == 0.0
    with pytest.raises(InvalidRequest):
        defaults_from_generation_config({"top_k": "many"})


def test_top_k_ids_with_a_masked_full_size_vocabulary():
    """Most of Ling's 157,184 rows masked to one value: the ties at the bound are resolved
    by id without ranking the whole vocabulary."""
    rng = np.random.default_rng(5)
    x = np.full(157_184, -1e4, np.float32)
    live = rng.choice(x.size, 30, replace=False)
    x[live] = rng.standard_normal(30).astype(np.float32)
    want = np.lexsort((np.arange(x.size), -x))[:40]
    np.testing.assert_array_equal(top_k_ids(x, 40), want)
    np.testing.assert_array_equal(top_k_ids(x, 20), want[:20])


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_bucketed_nucleus_matches_reference(min_p):
    """A flat distribution where the top-64 guess is not enough: the bucketed path."""
    x = (np.random.default_rng(11).standard_normal(3000) * 0.5).astype(np.float32)
    s = SamplerSettings(temperature=0.8, top_p=0.5, min_p=min_p, seed=4)
    want = reference_distribution(x, s)
    assert np.count_nonzero(want) > 64
    got = empirical(x, s, 30000)
    support = set(np.flatnonzero(want))
    assert set(np.flatnonzero(got)) <= support
    assert len(set(np.flatnonzero(got))) > 0.9 * len(support)
    assert np.abs(got - want).max() < 0.004


def test_penalty_bookkeeping_grows_past_its_initial_capacity():
    s = SamplerSettings(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    sampler = Sampler(s, 1000, prompt_ids=[999])
    for t in range(300):
        sampler.accept(t)
        sampler.accept(t)
    x = np.ones(1000, np.float32)
    out = sampler._apply_penalties(x)
    np.testing.assert_allclose(out[:300], 0.5 - 2.0)
    np.testing.assert_allclose(out[300:999], 1.0)
    assert out[999] == 0.5


def test_repetition_penalty_pushes_a_seen_negative_logit_further_down():
    """transformers' rule for a seen token with a negative logit: multiply by the penalty
    (more negative, less likely); dividing would raise it toward 0 and favour repeating."""
    x = np.array([-1.0, -1.5, -3.0], np.float32)
    s = SamplerSettings(temperature=0.0, repetition_penalty=2.0)
    sampler = Sampler(s, 3, prompt_ids=[0])
    np.testing.assert_allclose(sampler._apply_penalties(x), [-2.0, -1.5, -3.0], rtol=1e-6)
    assert sampler.sample(x) == 1  # the seen id 0 (-1.0 -> -2.0) falls below id 1

"""Token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws.

The processing order follows transformers' generate() (penalties, temperature, top-k,
top-p, min-p) so results can be checked against it. Selection is partial: a block-maximum
bound narrows the vocabulary to a handful of candidates before anything is sorted, so a
157,184-entry vocabulary costs a few linear passes per token, never a full sort. Ties are
broken towards the lower token id everywhere, which keeps greedy output deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .api import InvalidRequest, SamplingParams

_BLOCK = 256  # block size of the block-maximum bound used for partial selection
_TOP_P_FIRST_GUESS = 64  # candidates tried first when top-p runs without top-k
_BUCKETS = 4096  # probability buckets of the top-p search over the whole vocabulary
_Z_FLOOR = 40.0  # scaled logits below -40 share the lowest bucket (mass < V * e^-40)

# Ling-3.0-tiny's generation_config.json (docs/model.md section 8).
LING3_GENERATION_DEFAULTS = SamplingParams(temperature=1.0, top_p=0.95, top_k=20)


@dataclass(frozen=True)
class SamplerSettings:
    """Fully resolved sampling knobs (no ``None`` left)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def defaults_from_generation_config(config: Mapping[str, Any]) -> SamplingParams:
    """Read sampling defaults from a Hugging Face ``generation_config.json`` mapping.

    Missing keys fall back to Ling-3.0-tiny's published defaults; ``do_sample: false``
    means greedy, as in transformers.
    """
    base = LING3_GENERATION_DEFAULTS

    def pick(key: str, fallback: Any, kind: type) -> Any:
        value = config.get(key, fallback)
        if value is None:
            return fallback
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"generation config: {key} must be a number, got {value!r}")
        return kind(value)

    temperature = pick("temperature", base.temperature, float)
    if config.get("do_sample") is False:
        temperature = 0.0
    return SamplingParams(
        temperature=temperature,
        top_p=pick("top_p", base.top_p, float),
        top_k=pick("top_k", base.top_k, int),
        min_p=pick("min_p", 0.0, float),
        repetition_penalty=pick("repetition_penalty", 1.0, float),
    )


# Beyond these a penalty divides or multiplies a logit past float range (1e-300 turned
# every seen token's logit infinite and failed the generation as a model error).
REPETITION_PENALTY = (0.01, 100.0)


def _first(value: float | None, default: float | None, fallback: float) -> float:
    """The request's knob, else the default's, else the sampler's neutral value."""
    if value is not None:
        return value
    return fallback if default is None else default


def resolve_settings(request: SamplingParams, defaults: SamplingParams) -> SamplerSettings:
    """Merge a request's knobs over the defaults and validate every value."""

    r, d = request, defaults
    s = SamplerSettings(
        temperature=float(_first(r.temperature, d.temperature, 1.0)),
        top_k=int(_first(r.top_k, d.top_k, 0)),
        top_p=float(_first(r.top_p, d.top_p, 1.0)),
        min_p=float(_first(r.min_p, d.min_p, 0.0)),
        repetition_penalty=float(_first(r.repetition_penalty, d.repetition_penalty, 1.0)),
        presence_penalty=float(_first(r.presence_penalty, d.presence_penalty, 0.0)),
        frequency_penalty=float(_first(r.frequency_penalty, d.frequency_penalty, 0.0)),
        seed=r.seed if r.seed is not None else d.seed,
    )
    low, high = REPETITION_PENALTY
    checks = [
        (math.isfinite(s.temperature) and s.temperature >= 0.0, "temperature",
         "temperature must be >= 0"),
        (s.top_k >= -1, "top_k", "top_k must be >= 0 (0 or -1 disables it)"),
        (0.0 < s.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
        (0.0 <= s.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
        (
            math.isfinite(s.repetition_penalty) and low <= s.repetition_penalty <= high,
            "repetition_penalty", f"repetition_penalty must be in [{low:g}, {high:g}]",
        ),
        (math.isfinite(s.presence_penalty), "presence_penalty",
         "presence_penalty must be finite"),
        (math.isfinite(s.frequency_penalty), "frequency_penalty",
         "frequency_penalty must be finite"),
        (s.seed is None or (isinstance(s.seed, int) and s.seed >= 0), "seed",
         "seed must be a non-negative integer"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequest(message, param)
    if s.top_k < 0:
        s = SamplerSettings(**{**s.__dict__, "top_k": 0})
    return s


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, ordered by value descending then id ascending.

    Every block's maximum is an element of ``x``, so the k-th largest block maximum is a
    lower bound for the k-th largest value; only elements above that bound are ranked.
    """
    n = x.shape[0]
    starts = np.arange(0, n, _BLOCK)
    if k >= n or starts.size <= k:
        candidates = np.arange(n)
    else:
        block_max = np.maximum.reduceat(x, starts)
        bound = np.partition(block_max, starts.size - k)[starts.size - k]
        candidates = np.flatnonzero(x > bound)
        if candidates.size < k:  # the bound itself is among the top k (ties at it)
            ties = np.flatnonzero(x == bound)[: k - candidates.size]
            candidates = np.concatenate([candidates, ties])
    values = x[candidates]
    if candidates.size > k:
        kth = np.partition(values, candidates.size - k)[candidates.size - k]
        above = candidates[values > kth]
        ties = candidates[values == kth][: k - above.size]  # candidates ascend by id
        candidates = np.concatenate([above, ties])
        values = x[candidates]
    if candidates.size < min(k, n):
        raise FloatingPointError("logits are not finite")  # NaN compares false everywhere
    order = np.lexsort((candidates, -values))
    return candidates[order]


class Sampler:
    """Per-request sampler; remembers the tokens it needs for penalties."""

    def __init__(
        self, settings: SamplerSettings, vocab_size: int, prompt_ids: Iterable[int] = ()
    ) -> None:
        self.settings = settings
        self._vocab_size = vocab_size
        self._rng = np.random.default_rng(settings.seed)
        self._seen: dict[int, None] = dict.fromkeys(
            int(t) for t in prompt_ids if 0 <= int(t) < vocab_size
        )
        # The same ids as an array with spare room, so a new token is an O(1) append.
        self._seen_array = np.zeros(max(64, 2 * len(self._seen)), np.int64)
        self._seen_array[: len(self._seen)] = list(self._seen)
        # Output token counts, kept as parallel arrays so a step costs no rebuild.
        self._output_slot: dict[int, int] = {}
        self._output_ids = np.zeros(64, np.int64)
        self._output_counts = np.zeros(64, np.float32)
        self._penalised = (
            settings.repetition_penalty != 1.0
            or settings.presence_penalty != 0.0
            or settings.frequency_penalty != 0.0
        )

    def accept(self, token_id: int) -> None:
        """Record a generated token (feeds the penalties)."""
        if token_id not in self._seen:
            n = len(self._seen)
            self._seen[token_id] = None
            if n == self._seen_array.shape[0]:
                self._seen_array = np.resize(self._seen_array, 2 * n)
            self._seen_array[n] = token_id
        slot = self._output_slot.get(token_id)
        if slot is None:
            slot = self._output_slot[token_id] = len(self._output_slot)
            if slot == self._output_ids.shape[0]:
                self._output_ids = np.resize(self._output_ids, 2 * slot)
                self._output_counts = np.concatenate(
                    [self._output_counts, np.zeros(slot, np.float32)]
                )
            self._output_ids[slot] = token_id
        self._output_counts[slot] += 1

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token from one row of logits; never modifies ``logits``."""
        x = self._apply_penalties(logits) if self._penalised else logits
        s = self.settings
        if s.greedy:
            token = int(np.argmax(x))
            if not math.isfinite(float(x[token])):
                raise FloatingPointError("logits are not finite")
            return token
        if s.top_k == 0 and s.top_p >= 1.0 and s.min_p == 0.0:
            return self._sample_full(x)
        return self._sample_candidates(x)

    # -- internals -----------------------------------------------------------------

    def _apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        s = self.settings
        x = np.array(logits, dtype=np.float32, copy=True)
        if s.repetition_penalty != 1.0 and self._seen:
            ids = self._seen_array[: len(self._seen)]
            v = x[ids]
            x[ids] = np.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
        n = len(self._output_slot)
        if (s.presence_penalty != 0.0 or s.frequency_penalty != 0.0) and n:
            ids = self._output_ids[:n]
            counts = self._output_counts[:n]
            x[ids] -= np.float32(s.presence_penalty) + np.float32(s.frequency_penalty) * counts
        return x

    def _draw(self, weights: np.ndarray) -> int:
        """Index drawn with probability proportional to ``weights`` (float64, >= 0)."""
        cumulative = np.cumsum(weights)
        total = cumulative[-1]
        if not (math.isfinite(total) and total > 0.0):
            raise FloatingPointError("logits are not finite")
        index = int(np.searchsorted(cumulative, self._rng.random() * total, side="right"))
        return min(index, weights.shape[0] - 1)

    def _sample_full(self, x: np.ndarray) -> int:
        """Plain temperature sampling over the whole vocabulary (no selection at all)."""
        z = (x.astype(np.float64) - float(np.max(x))) / self.settings.temperature
        return self._draw(np.exp(z))

    def _sample_candidates(self, x: np.ndarray) -> int:
        s = self.settings
        t = s.temperature
        if s.top_k > 0:
            candidates = top_k_ids(x, s.top_k)
            z = (x[candidates].astype(np.float64) - float(x[candidates[0]])) / t
            p = np.exp(z)
            probs = p / p.sum()
        elif s.top_p < 1.0:
            return self._sample_top_p_full(x)
        else:  # min-p alone: every token within the min-p ratio of the best one
            x_max = float(np.max(x))
            pool = np.flatnonzero(x >= np.float32(x_max + t * math.log(s.min_p)))
            order = np.lexsort((pool, -x[pool]))
            candidates = pool[order]
            z = (x[candidates].astype(np.float64) - x_max) / t
            p = np.exp(z)
            probs = p / p.sum()
        keep = candidates.shape[0]
        if s.top_p < 1.0:
            exclusive = np.cumsum(probs) - probs  # mass strictly before each candidate
            keep = max(1, int(np.count_nonzero(exclusive < s.top_p)))
        if s.min_p > 0.0:
            keep = max(1, min(keep, int(np.count_nonzero(z >= math.log(s.min_p)))))
        return int(candidates[self._draw(p[:keep])])

    def _sample_top_p_full(self, x: np.ndarray) -> int:
        """Top-p (and min-p) without top-k: the nucleus can be most of the vocabulary.

        First try the top 64 tokens (enough for peaked distributions); otherwise bucket the
        probabilities by scaled logit, find the bucket where the cumulative mass crosses
        top-p, and rank only the tokens inside that one bucket.
        """
        s = self.settings
        t = s.temperature
        x_max = float(np.max(x))
        z_all = (x - np.float32(x_max)) / np.float32(t)  # <= 0
        weights = np.exp(z_all)
        normaliser = float(weights.sum(dtype=np.float64))
        if not (math.isfinite(normaliser) and normaliser > 0.0):
            raise FloatingPointError("logits are not finite")
        head = top_k_ids(x, min(_TOP_P_FIRST_GUESS, x.shape[0]))
        z = z_all[head].astype(np.float64)
        probs = np.exp(z) / normaliser
        if probs.sum() >= s.top_p:
            exclusive = np.cumsum(probs) - probs
            keep = max(1, int(np.count_nonzero(exclusive < s.top_p)))
            if s.min_p > 0.0:
                keep = max(1, min(keep, int(np.count_nonzero(z >= math.log(s.min_p)))))
            return int(head[self._draw(np.exp(z[:keep]))])
        # Bucketed nucleus: tokens below z = -_Z_FLOOR carry < V * e^-40 of the mass.
        scale = _BUCKETS / _Z_FLOOR
        # Clipped before the cast: a masked (-inf) logit must not reach the int conversion.
        floor = np.maximum(z_all, np.float32(-_Z_FLOOR))
        bucket = np.minimum(((floor + _Z_FLOOR) * scale).astype(np.int64), _BUCKETS - 1)
        mass = np.bincount(bucket, weights=weights, minlength=_BUCKETS) / normaliser
        above = np.cumsum(mass[::-1])[::-1] - mass  # mass in strictly higher buckets
        cut = int(np.flatnonzero(above < s.top_p)[0])  # lowest bucket that is reached
        kept = np.flatnonzero(bucket > cut)
        edge = np.flatnonzero(bucket == cut)
        edge = edge[np.lexsort((edge, -x[edge]))]
        edge_probs = weights[edge].astype(np.float64) / normaliser
        exclusive = above[cut] + np.cumsum(edge_probs) - edge_probs
        edge = edge[: max(1, int(np.count_nonzero(exclusive < s.top_p)))]
        chosen = np.concatenate([kept, edge])
        if s.min_p > 0.0:
            chosen = chosen[z_all[chosen] >= math.log(s.min_p)]
            if chosen.size == 0:
                chosen = top_k_ids(x, 1)
        chosen.sort()
        return int(chosen[self._draw(weights[chosen].astype(np.float64))])

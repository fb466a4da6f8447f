"""The engine's knobs as one typed, frozen value.

``ling3_rknn.loading`` builds it from what the operator set (``serve``'s flags) and what
the model brings (its context limit, generation config and weights identity); tests build
it directly. Values are checked here, so a bad one fails before a model is touched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from .api import SamplingParams
from .grammar_constraint import DEFAULT_GRAMMAR_CACHE_BYTES
from .sampler import LING3_GENERATION_DEFAULTS

DEFAULT_CACHE_BYTES = 2 << 30  # 2 GiB: ~100 snapshots of the real model's ~20 MB state
# Output tokens of a request that names no max_tokens (``serve --default-max-tokens``): at
# ~20 tokens/s on the board, a runaway answer holds the single stream ~3.5 minutes instead
# of the ~27 a 32K context would take (README, "Serving").
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class EngineOptions:
    """Everything ``Engine`` is configured with besides the model and the tokenizer."""

    model_id: str  # the id the server answers to
    max_context: int  # prompt plus answer, in tokens
    cache_bytes: int = DEFAULT_CACHE_BYTES  # the prefix cache in memory; 0: no cache
    cache_dir: str | os.PathLike[str] | None = None  # persist the prefix cache here
    cache_disk_bytes: int | None = None  # None: four times ``cache_bytes``
    # Names the weights in the persisted snapshots' fingerprint (a bundle's manifest
    # hash); None: a digest of the logits of a probe sequence.
    weights_identity: str | None = None
    generation_defaults: SamplingParams = LING3_GENERATION_DEFAULTS
    max_queue: int = 16  # requests waiting for the worker before EngineBusy
    prefill_chunk: int = 64  # prompt tokens per model call
    checkpoint_min_tokens: int = 64  # no boundary snapshot closer than this to another
    eos_token_ids: Sequence[int] = ()  # the generation config's end-of-sequence ids
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES  # compiled grammars kept
    # The answer cap of a request that sends no max_tokens; None: the context limit.
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if self.max_context < 2:
            raise ValueError("max_context must be at least 2")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1 (None: no cap)")
        if self.max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")

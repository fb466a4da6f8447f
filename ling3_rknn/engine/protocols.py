"""What the engine calls on the model and the tokenizer, declared once.

The engine is written against these Protocols rather than ``ling3_rknn.model.Model`` and
``ling3_rknn.tokenizer.Tokenizer``, so scripted doubles stand in for them in the unit
tests. Every member here is required: the engine never probes for an attribute, and the
type checker (``make lint``) holds the real classes and the doubles to the same contract.
What the server hands in per request (the turn parser, the grammar) is declared in
``api``; what the grammar masks and the prompt encoder need from the tokenizer is declared
where they use it (``GrammarTokenizer``, ``SegmentEncoder``) and gathered here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ..model.snapshot_arrays import SnapshotArrays
from .grammar_constraint import GrammarTokenizer
from .prompt_encoder import SegmentEncoder


class ModelConfigLike(Protocol):
    """The model config fields the engine and the loader read (``config.ModelConfig``).
    The whole config also goes into the persisted snapshots' fingerprint
    (``cache.snapshot_store.model_fingerprint``)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """Every end-of-sequence id of the model config: generation stops on each."""
        ...

    @property
    def max_position_embeddings(self) -> int: ...


class CacheableSnapshot(Protocol):
    """What the prefix cache's budget reads of a snapshot: its size, and the arrays it
    shares with other snapshots (charged once however many hold them)."""

    @property
    def nbytes(self) -> int:
        """Every byte it references (an upper bound when blocks are shared)."""
        ...

    @property
    def private_nbytes(self) -> int:
        """The bytes only it holds: ``nbytes`` less its shared blocks."""
        ...

    def shared_blocks(self) -> tuple[np.ndarray, ...]:
        """Read-only arrays it may share with other snapshots, keyed by identity (the
        frozen latent blocks); () for a snapshot that shares nothing."""
        ...


class SnapshotLike(CacheableSnapshot, Protocol):
    """A frozen copy of a state: what the prefix cache keeps and writes to disk."""

    def to_arrays(self) -> Mapping[str, np.ndarray]:
        """Named arrays, one per name; the model's ``snapshot_from_arrays`` reads them
        back."""
        ...

    def blocked_arrays(self) -> SnapshotArrays:
        """The same, frozen latent rows as the blocks they already are: what the disk
        tier writes (docs/serving.md 8)."""
        ...


class StateLike(Protocol):
    """The model's live sequence state, advanced by ``forward``."""

    def snapshot(self) -> SnapshotLike: ...

    def restore(self, snapshot: Any) -> None:
        """Become the state ``snapshot`` was taken from. ``snapshot`` is one this model's
        states took or its ``snapshot_from_arrays`` read (typed Any: each model restores
        only its own snapshot type, and the engine never mixes models)."""
        ...


StateT = TypeVar("StateT", bound=StateLike)


class ModelLike(Protocol[StateT]):
    """What the engine needs from ``ling3_rknn.model.Model``."""

    @property
    def config(self) -> ModelConfigLike: ...

    @property
    def latent_dtype(self) -> str:
        """The dtype its states keep the MLA latent cache in ("float32" or "float16"):
        snapshots of another dtype are another model's, so it names the disk store."""
        ...

    def new_state(self) -> StateT: ...

    def forward(
        self, token_ids: Sequence[int], state: StateT, *, last_only: bool = False
    ) -> np.ndarray:
        """Float32 logits [T, vocab] for ``token_ids`` ([1, vocab] with ``last_only``),
        advancing ``state`` by T tokens."""
        ...

    def snapshot_from_arrays(self, arrays: SnapshotArrays) -> SnapshotLike:
        """A snapshot from ``to_arrays`` or ``blocked_arrays`` output (the disk tier's
        reader)."""
        ...


class StreamDecoderLike(Protocol):
    """Ids to text one at a time, holding an incomplete UTF-8 sequence back."""

    def feed(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


class TokenizerLike(SegmentEncoder, GrammarTokenizer, Protocol):
    """What the engine needs from ``ling3_rknn.tokenizer.Tokenizer``: prompt encoding
    (``SegmentEncoder``), llguidance's view for grammar masks (``GrammarTokenizer``), and
    the members below."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoderLike: ...

    @property
    def turn_ending_ids(self) -> frozenset[int]:
        """Special tokens that end a generated turn besides ``eos_id`` (a role header, a
        made-up tool result): the turn ends there and they never reach the client."""
        ...

    @property
    def max_token_bytes(self) -> int:
        """The longest token's UTF-8 length: N characters are at least N / this many
        tokens (the engine refuses an overlong prompt before encoding it)."""
        ...

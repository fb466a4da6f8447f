"""A scripted model double with the real model's interface, for engine unit tests.

Its logits are a deterministic function of the whole token history, so any mistake in
restoring cached state shows up as different output. The real model runs through the
engine in tests/test_engine_agent_loop.py, behind ``DelegatingModel`` where a test needs
to watch or bend it.

Every double here implements the whole of the engine's protocols
(``ling3_rknn.engine.protocols``) and is type-checked against them (``make lint`` runs
mypy over this file: see the ``TYPE_CHECKING`` block at the end).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ling3_rknn.engine.protocols import ModelConfigLike
from ling3_rknn.model.snapshot_arrays import SnapshotArrays, joined

if TYPE_CHECKING:  # only annotations: the scripted doubles never load the model package
    from ling3_rknn.model import Model, SequenceState, StateSnapshot


@dataclass(frozen=True)
class ScriptedConfig:
    """The config fields the engine reads (``ModelConfigLike``)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096


class SharesNothing:
    """The sharing half of ``CacheableSnapshot`` for snapshot doubles that share no arrays:
    everything they hold is their own."""

    @property
    def nbytes(self) -> int:
        raise NotImplementedError  # the double's own

    @property
    def private_nbytes(self) -> int:
        return self.nbytes

    def shared_blocks(self) -> tuple[np.ndarray, ...]:
        return ()


@dataclass(frozen=True)
class FakeSnapshot(SharesNothing):
    tokens: tuple[int, ...]
    size: int = 4096

    @property
    def nbytes(self) -> int:
        return self.size

    @property
    def length(self) -> int:
        return len(self.tokens)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": np.asarray(self.tokens, np.int64)}

    def blocked_arrays(self) -> dict[str, np.ndarray]:
        return self.to_arrays()  # nothing per-token to hand over in blocks

    @staticmethod
    def from_arrays(arrays: SnapshotArrays) -> FakeSnapshot:
        return FakeSnapshot(tuple(int(t) for t in joined(arrays)["tokens"]))


class FakeState:
    def __init__(self, snapshot_size: int) -> None:
        self.tokens: list[int] = []
        self._size = snapshot_size

    @property
    def length(self) -> int:
        return len(self.tokens)

    def snapshot(self) -> FakeSnapshot:
        return FakeSnapshot(tuple(self.tokens), self._size)

    def restore(self, snapshot: FakeSnapshot) -> None:
        self.tokens = list(snapshot.tokens)


class ScriptedModel:
    """``next_token(history) -> id`` decides the argmax after each position."""

    latent_dtype = "float32"

    def __init__(
        self,
        vocab_size: int,
        next_token: Callable[[Sequence[int]], int],
        *,
        eos_token_ids: tuple[int, ...] = (),
        delay: float = 0.0,
        snapshot_size: int = 4096,
    ) -> None:
        self.config = ScriptedConfig(vocab_size, eos_token_ids)
        self._next = next_token
        self.delay = delay
        self.snapshot_size = snapshot_size
        self.calls: list[list[int]] = []  # ids of every forward call, in order
        self.fail_when: Callable[[Sequence[int]], bool] | None = None
        self.nan_when: Callable[[Sequence[int]], bool] | None = None
        self.gate: threading.Event | None = None  # when set, forward waits for it

    def new_state(self) -> FakeState:
        return FakeState(self.snapshot_size)

    def snapshot_from_arrays(self, arrays: SnapshotArrays) -> FakeSnapshot:
        return FakeSnapshot.from_arrays(arrays)

    @property
    def evaluated(self) -> int:
        return sum(len(c) for c in self.calls)

    def forward(
        self, token_ids: Sequence[int], state: FakeState, *, last_only: bool = False
    ) -> np.ndarray:
        ids = [int(t) for t in token_ids]
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        self.calls.append(ids)
        if self.fail_when is not None and self.fail_when([*state.tokens, *ids]):
            state.tokens.append(-1)  # leave the state half-updated, like a real failure
            raise RuntimeError("NPU timeout")
        rows = []
        for t in ids:
            state.tokens.append(t)
            row = np.zeros(self.config.vocab_size, np.float32)
            row[self._next(state.tokens)] = 10.0
            if self.nan_when is not None and self.nan_when(state.tokens):
                row[:] = np.nan
            rows.append(row)
        out = np.stack(rows)
        return out[-1:] if last_only else out


def answer_script(answer: Sequence[int], after: int, eos: int) -> Callable[[Sequence[int]], int]:
    """After the last ``after`` token, emit ``answer`` then ``eos``; otherwise ``eos``."""

    def next_token(history: Sequence[int]) -> int:
        for k in range(len(history) - 1, -1, -1):
            if history[k] == after:
                n = len(history) - 1 - k
                return answer[n] if n < len(answer) else eos
        return eos

    return next_token


class DelegatingModel:
    """The real model behind the engine's protocol; subclasses watch or bend ``forward``."""

    def __init__(self, model: Model) -> None:
        self._model = model

    @property
    def config(self) -> ModelConfigLike:
        return self._model.config

    @property
    def latent_dtype(self) -> str:
        return self._model.latent_dtype

    def new_state(self) -> SequenceState:
        return self._model.new_state()

    def snapshot_from_arrays(self, arrays: SnapshotArrays) -> StateSnapshot:
        return self._model.snapshot_from_arrays(arrays)

    def forward(
        self, token_ids: Sequence[int], state: SequenceState, *, last_only: bool = False
    ) -> np.ndarray:
        return self._model.forward(token_ids, state, last_only=last_only)


if TYPE_CHECKING:  # mypy holds each double to the protocol the engine calls it through
    from ling3_rknn.engine.protocols import ModelLike, SnapshotLike, StateLike

    _models: tuple[type[ModelLike[FakeState]], type[ModelLike[SequenceState]]] = (
        ScriptedModel, DelegatingModel)
    _state: type[StateLike] = FakeState
    _snapshot: type[SnapshotLike] = FakeSnapshot

"""The engine's public contract, shared by the engine and the server.

The server renders OpenAI messages to typed segments (``ling3_rknn.chat``) and hands them
to the engine; the engine owns tokenization (so it can splice in token ids it generated
earlier and keep the prefix cache hitting), the model, the sampler and the prefix cache.
Kept in its own module so a scripted test double can implement the same interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol


class SegmentLike(Protocol):
    """A piece of rendered prompt; only ``control`` text may become special tokens."""

    @property
    def text(self) -> str: ...

    @property
    def control(self) -> bool: ...


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs; ``None`` means "use the bundle's generation config default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[SegmentLike]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: up to the context limit
    stop: Sequence[str] = ()
    # Maps the generated text to the text the template will render for it when the client
    # sends the turn back as history (``ling3_rknn.chat.history_text``), or None when it
    # cannot. Lets the engine reuse the generated ids even when the template normalises
    # the model's spacing; without it the generated text is assumed to re-render verbatim.
    history_text: Callable[[str], str | None] | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from the prefix cache, not evaluated


@dataclass(frozen=True)
class Admitted:
    """First event of every generation: the prompt is encoded, fits the context and holds
    a place in the queue. Every refusal that needs no generation (busy, prompt too long,
    bad request) is raised before it, however long encoding took, so a server sends its
    response headers only after this event and never has to turn a refusal into an error
    event."""

    prompt_tokens: int


@dataclass(frozen=True)
class TextDelta:
    """Newly decoded text; never half a UTF-8 character, never part of a stop string."""

    text: str
    token_ids: tuple[int, ...]


FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Finished:
    """Last event of every generation that was not cancelled by the consumer."""

    finish_reason: FinishReason
    usage: Usage
    text: str  # the whole generated text, without the EOS marker or a matched stop string


GenerationEvent = Admitted | TextDelta | Finished


class EngineError(Exception):
    """Base of the engine's typed errors."""


class ContextLengthExceeded(EngineError):
    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_context} tokens; "
            f"the prompt has {prompt_tokens} tokens."
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


class EngineBusy(EngineError):
    """The request queue is full; the server answers 503 with Retry-After."""


class EngineFailure(EngineError):
    """The model or NPU failed; the engine stays usable for the next request."""



class EngineShutDown(EngineFailure):
    """The engine was closed (service shutdown) before or while serving the request: not a
    model failure, and a retry belongs elsewhere; the server answers 503 ``shutdown``."""

class InvalidRequest(EngineError, ValueError):
    """A request value the engine cannot honour (bad sampling knob, empty prompt); the
    server answers 400. Raised before the first event, like ContextLengthExceeded."""


@dataclass(frozen=True)
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually evaluated during prefill
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cache_hits: int = 0
    cache_tokens_reused: int = 0
    cache_bytes: int = 0
    queue_depth: int = 0
    npu_errors: int = 0
    cache_entries: int = 0  # snapshots indexed (in memory or on disk)
    cache_disk_bytes: int = 0
    cancelled: int = 0  # requests whose consumer went away before the end


class EngineProtocol(Protocol):
    """What the server needs. ``generate`` raises ContextLengthExceeded, EngineBusy or
    InvalidRequest before yielding anything, then yields ``Admitted`` first; closing the
    iterator (or cancelling the consuming task) cancels the generation within one token
    and leaves the engine clean."""

    model_id: str
    max_context: int

    @property
    def ready(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...

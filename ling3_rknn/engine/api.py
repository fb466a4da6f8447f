"""The engine's public contract, shared by the engine and the server.

The events a generation yields are the token stream's one vocabulary, defined once in
``ling3_rknn.chat.events`` (a leaf every layer imports).

The server renders OpenAI messages to typed segments (``ling3_rknn.chat``) and hands them
to the engine; the engine owns tokenization (so it can splice in token ids it generated
earlier and keep the prefix cache hitting), the model, the sampler and the prefix cache.
Kept in its own module so a scripted test double can implement the same interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ling3_rknn.chat.events import GenerationEvent, ParseEvent
from ling3_rknn.chat.segments import SegmentLike


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


class TurnParser(Protocol):
    """Splits one turn's generated text as it streams; see ``chat.StreamingParser``."""

    def feed(self, text: str) -> Sequence[ParseEvent]: ...

    def finish(self) -> Sequence[ParseEvent]: ...

    @property
    def reasoning_done(self) -> bool:
        """The reasoning block is over (or the turn has none): what follows is the answer.
        The engine counts the tokens fed before that as reasoning tokens."""
        ...

    def history_text(self) -> str | None:
        """After ``finish()``: the text the template renders for this turn when a client
        sends it back, or None when it would not reproduce the generation prompt."""
        ...


class GrammarText(Protocol):
    """A compiled-to-text grammar (``chat.turn_grammar.GrammarText``)."""

    @property
    def lark(self) -> str: ...

    @property
    def bounds(self) -> Mapping[str, Mapping[str, int]]:
        """Tool name -> {parameter: the length bound (tokens) the budget gave its string
        values}; empty without a budget. The engine reports a value cut there as a
        truncated answer."""
        ...

    def part_at_line(self, line: int) -> str | None: ...


class GrammarSource(Protocol):
    """What one turn must look like (``chat.TurnGrammar``); the engine supplies the token
    ids of the format's markers and compiles the text against its tokenizer."""

    def lark(self, token_ids: Mapping[str, int]) -> GrammarText:
        """Raises ``chat.GrammarError`` (a ValueError naming the request part) for a shape
        the grammar cannot express."""
        ...

    @property
    def trigger(self) -> str | None:
        """The marker whose sampling enters a lazy grammar; None: the grammar holds from
        the answer's first token."""
        ...

    def with_budget(self, tokens: int) -> GrammarSource:
        """This grammar for an answer of at most ``tokens`` tokens."""
        ...

    def relaxed(self, part: str | None) -> GrammarSource | None:
        """This grammar with the request part the constraint library refused left free,
        where the client did not demand it; None: the refusal is the request's 400."""
        ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Sequence[SegmentLike]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the engine's default cap, else the context limit
    stop: Sequence[str] = ()
    # Makes the parser of this turn (``ling3_rknn.chat.StreamingParser``). With one the
    # engine emits what it makes of the text (reasoning, content, tool calls) instead of
    # raw ``TextDelta``s, and keys the turn's generated ids by its ``history_text()``, so
    # the ids are reused even when the template normalises the model's spacing; without
    # one the generated text is assumed to re-render verbatim.
    parser: Callable[[], TurnParser] | None = None
    # Constrained decoding: every sampled token must continue this grammar (the engine
    # masks the logits before temperature, top-k and top-p). None: unconstrained.
    grammar: GrammarSource | None = None
    # Markers (special-token spellings) never sampled in this answer, or, with a lazy
    # grammar, never before its trigger: the call markers where no call is possible.
    banned_markers: Sequence[str] = ()
    # Markers sampled at most once in this answer (before a lazy grammar's trigger): the
    # reasoning's close, where the generation prompt opened the reasoning.
    once_markers: Sequence[str] = ()


class EngineError(Exception):
    """Base of the engine's typed errors."""


class ContextLengthExceeded(EngineError):
    """``at_least``: the prompt was refused before it was encoded whole, so its length is
    a lower bound."""

    def __init__(self, prompt_tokens: int, max_context: int, *, at_least: bool = False) -> None:
        super().__init__(
            f"This model's maximum context length is {max_context} tokens; "
            f"the prompt has {'at least ' if at_least else ''}{prompt_tokens} tokens."
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
    """A request value the engine cannot honour (bad sampling knob, empty prompt, a grammar
    the constraint library refuses); the server answers 400, naming ``param`` when set.
    Raised before the first event, like ContextLengthExceeded, except for a grammar that
    exceeds the library's limits while generating."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    grammar_cache_bytes: int = 0  # compiled grammars kept (engine/grammar_constraint.py)
    grammar_cache_entries: int = 0


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

    def encode_prompt(self, segments: Sequence[SegmentLike]) -> list[int]:
        """The ids ``generate`` would evaluate or restore for ``segments``, unbounded and
        blocking (diagnostics and benches; never on a client's text in the server)."""
        ...

    async def count_prompt(self, segments: Sequence[SegmentLike]) -> int:
        """How many tokens ``generate`` would evaluate or restore for ``segments``, with its
        bounds: ContextLengthExceeded when they cannot fit (before encoding when the length
        alone says so), InvalidRequest when the text cannot be encoded; the encoding runs
        off the event loop and stops when the awaiting task is cancelled. Serves token
        counting (``/v1/messages/count_tokens``)."""
        ...

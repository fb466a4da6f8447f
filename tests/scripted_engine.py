"""A scripted test double of the engine (``EngineProtocol``) for server protocol tests.

Random-weight models never write a tool call or a reasoning block on purpose, so the
protocol tests script the generated text here: each generation pops the next ``Script``
(pieces of text, finish reason, usage) or fails the way the real engine can (busy, prompt
too long, model failure). Generations run one at a time like the real single-worker
engine, and a generation closed or cancelled by its consumer is counted, so tests can prove
that a client disconnect cancels the work.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ling3_rknn.chat.events import Admitted, Finished, GenerationEvent, TextDelta, Usage
from ling3_rknn.engine.api import (
    ContextLengthExceeded,
    EngineBusy,
    EngineFailure,
    EngineStats,
    GenerationRequest,
    InvalidRequest,
    SegmentLike,
)
from ling3_rknn.engine.parsed_turn import ParsedTurn

# A thinking model's answer with one tool call, in the uneven pieces a tokenizer streams,
# after the generation prompt "<role>ASSISTANT</role>\n<think>".
ONE_CALL = [
    "Need the",
    " file.</th",
    "ink><tool_",
    "call>read\n<arg_key>pa",
    "th</arg_key>\n<arg_value>a.py</arg_",
    "value><arg_key>limit</arg_key>\n<arg_value>20</arg_value>\n</tool_call>",
]


@dataclass
class Script:
    pieces: list[str] = field(default_factory=lambda: ["</think>Hello", " world", "!"])
    finish_reason: str = "stop"
    stop: str | None = None  # the stop string the engine reports as having ended the text
    cached_tokens: int = 0
    piece_delay_s: float = 0.0
    prefill_delay_s: float = 0.0
    # "busy" | "context" | "invalid" | "failure_before" | "crash_before" | "failure_mid" | "hang"
    fail: str | None = None


def prompt_text(request: GenerationRequest) -> str:
    return "".join(segment.text for segment in request.prompt)


def count_tokens(text: str) -> int:
    """A stand-in tokenizer: one token per 4 characters, at least one."""
    return max(1, len(text) // 4)


class ScriptedEngine:
    def __init__(self, model_id: str = "ling-3.0-tiny", max_context: int = 4096) -> None:
        self.model_id = model_id
        self.max_context = max_context
        self.is_ready = True
        self.scripts: deque[Script] = deque()
        self.default = Script()
        self.requests: list[GenerationRequest] = []
        self.started = 0
        self.completed = 0
        self.cancelled = 0
        self.closed = 0
        self.counted = 0  # count_prompt calls
        self.max_waiting = 8
        self._waiting = 0
        self._lock: asyncio.Lock | None = None
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._cache_hits = 0
        self._cache_reused = 0

    @property
    def ready(self) -> bool:
        return self.is_ready

    def close(self) -> None:
        self.closed += 1

    def push(self, *pieces: str, **options: object) -> Script:
        # ``options`` are Script's other fields, checked by its constructor at run time
        script = Script(pieces=list(pieces), **options)  # type: ignore[arg-type]
        self.scripts.append(script)
        return script

    def encode_prompt(self, segments: Sequence[SegmentLike]) -> list[int]:
        """The stand-in tokenizer's ids (one per 4 characters), as ``generate`` counts."""
        return list(range(count_tokens("".join(s.text for s in segments))))

    async def count_prompt(self, segments: Sequence[SegmentLike]) -> int:
        """``encode_prompt``'s count under ``generate``'s context bound."""
        self.counted += 1
        tokens = count_tokens("".join(s.text for s in segments))
        if tokens >= self.max_context:
            raise ContextLengthExceeded(tokens, self.max_context)
        return tokens

    def stats(self) -> EngineStats:
        return EngineStats(
            requests=self.started,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._completion_tokens,
            prefill_tokens=self._prompt_tokens - self._cache_reused,
            prefill_seconds=0.5,
            decode_tokens=self._completion_tokens,
            decode_seconds=0.25,
            cache_hits=self._cache_hits,
            cache_tokens_reused=self._cache_reused,
            cache_bytes=1234,
            queue_depth=self._waiting,
            npu_errors=0,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        script = self.scripts.popleft() if self.scripts else self.default
        self.requests.append(request)
        prompt_tokens = count_tokens(prompt_text(request))
        if script.fail == "busy" or self._waiting >= self.max_waiting:
            raise EngineBusy("The request queue is full.")
        if script.fail == "context" or prompt_tokens > self.max_context:
            raise ContextLengthExceeded(max(prompt_tokens, self.max_context + 1), self.max_context)
        if script.fail == "invalid":
            raise InvalidRequest("top_k must be >= 0")
        if script.fail == "failure_before":
            raise EngineFailure("NPU not responding")
        if script.fail == "crash_before":
            raise RuntimeError("secret internal detail /home/x/engine.py line 42")
        if self._lock is None:
            self._lock = asyncio.Lock()
        self._waiting += 1
        waiting = True
        try:
            yield Admitted(prompt_tokens)  # queued: every up-front refusal is behind us
            async with self._lock:
                self._waiting -= 1
                waiting = False
                self.started += 1
                self._prompt_tokens += prompt_tokens
                if script.cached_tokens:
                    self._cache_hits += 1
                    self._cache_reused += script.cached_tokens
                async for event in self._run(script, request, prompt_tokens):
                    yield event
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled += 1
            raise
        finally:
            if waiting:
                self._waiting -= 1

    async def _run(
        self, script: Script, request: GenerationRequest, prompt_tokens: int
    ) -> AsyncIterator[GenerationEvent]:
        if script.prefill_delay_s:
            await asyncio.sleep(script.prefill_delay_s)
        turn = ParsedTurn(request.parser)  # parsed as the real engine parses
        produced: list[str] = []
        for i, piece in enumerate(script.pieces):
            if script.fail == "failure_mid" and i == len(script.pieces) // 2:
                raise EngineFailure("NPU timeout")
            if script.piece_delay_s:
                await asyncio.sleep(script.piece_delay_s)
            produced.append(piece)
            self._completion_tokens += 1
            for event in turn.feed(TextDelta(piece, (i,))):
                yield event
        if script.fail == "hang":
            await asyncio.Event().wait()
        for event in turn.finish():
            yield event
        self.completed += 1
        usage = Usage(
            prompt_tokens, len(script.pieces), script.cached_tokens, turn.reasoning_tokens
        )
        yield Finished(script.finish_reason, usage, "".join(produced),  # type: ignore[arg-type]
                       stop=script.stop)


if TYPE_CHECKING:  # mypy holds the double to the contract the server calls it through
    from ling3_rknn.engine.api import EngineProtocol

    _engine: type[EngineProtocol] = ScriptedEngine

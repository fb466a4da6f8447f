"""One turn's decoded text through the request's parser: what the engine emits.

The engine decodes ids to ``TextDelta``s; with a parser every delta becomes the reasoning,
content and tool-call events the parser settles, and the turn's figures that only the
parse knows (how many tokens went to reasoning, the turn's history form) come from the
same pass. Without a parser the deltas pass through unchanged. Shared by the runner and
by test doubles of the engine, so both count reasoning tokens the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ling3_rknn.chat.events import (
    ContentDelta,
    GenerationEvent,
    ParseEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallParsed,
)
from ling3_rknn.chat.markers import THINK_CLOSE

from .api import TurnParser


class ParsedTurn:
    """Feed ``TextDelta``s, then ``finish()``; read ``reasoning_tokens`` and
    ``history_text()`` at the end."""

    def __init__(self, make_parser: Callable[[], TurnParser] | None) -> None:
        self._parser = make_parser() if make_parser is not None else None
        self._tokens = 0  # tokens of the deltas fed while the reasoning block was open
        self._answering = False  # a content delta or a call has been released
        self._saw_reasoning = False
        self._tail = ""  # the last characters fed, to see a </think> split across deltas

    @property
    def parsing(self) -> bool:
        return self._parser is not None

    def feed(self, delta: TextDelta) -> list[GenerationEvent]:
        if self._parser is None:
            return [delta]
        # A call is released only once complete, so "before the first answer event" would
        # count a call that follows the reasoning as reasoning; the parser knows better. The
        # delta that closes the block counts when it holds </think>, not when the block
        # ended at a <tool_call> (which belongs to the call).
        was_open = not self._answering and not self._parser.reasoning_done
        seen = self._tail + delta.text  # </think> may be split across deltas
        self._tail = seen[-(len(THINK_CLOSE) - 1):]
        events = self._track(self._parser.feed(delta.text))
        if was_open and (not self._parser.reasoning_done or THINK_CLOSE in seen):
            self._tokens += len(delta.token_ids)
        return events

    def finish(self) -> list[GenerationEvent]:
        return [] if self._parser is None else self._track(self._parser.finish())

    @property
    def reasoning_tokens(self) -> int:
        """Tokens generated while the reasoning block was open (with its closing marker);
        0 when the turn had no reasoning."""
        return self._tokens if self._saw_reasoning else 0

    def history_text(self, generated: str) -> str | None:
        """After ``finish()``: the parser's history form of the turn, or ``generated``
        itself without a parser; None when there is no form the next turn can match."""
        return generated if self._parser is None else self._parser.history_text()

    def _track(self, parsed: Sequence[ParseEvent]) -> list[GenerationEvent]:
        out: list[GenerationEvent] = []
        for event in parsed:
            if isinstance(event, ReasoningDelta):
                if not event.text:
                    continue
                self._saw_reasoning = True
            elif isinstance(event, ContentDelta):
                if not event.text:
                    continue
                self._answering = True
            elif isinstance(event, ToolCallParsed):
                self._answering = True
            out.append(event)
        return out

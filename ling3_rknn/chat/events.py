"""The token stream's one vocabulary, from the engine through the parser to the server.

A generation is ``Admitted``, then deltas, then ``Finished``. The engine decodes ids to
``TextDelta``; when the request carries a parser (every chat completion does) the engine
hands each delta to it and emits what it makes of the text instead: ``ReasoningDelta``,
``ContentDelta`` and ``ToolCallParsed``. The server turns exactly these into the OpenAI
wire format, so a streamed answer and a whole one are built from the same events
(docs/serving.md section 6.5).

Leaf module: plain records, importable from every layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from the prefix cache, not evaluated
    # Tokens generated before the first content or tool call was released (the reasoning
    # block plus the few tokens of its closing marker); 0 when there was no reasoning.
    reasoning_tokens: int = 0


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
    """Newly decoded text; never half a UTF-8 character, never part of a stop string.
    Emitted as is only when the request has no parser."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (never empty)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """Answer text (never empty)."""

    text: str


@dataclass(frozen=True)
class RawArguments:
    """A client's arguments string that is not a JSON object; rendered verbatim
    (``normalize``)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One function call, whichever way it travels: parsed from the model's output (no id
    until the server gives it one) or sent back by a client as history."""

    name: str
    arguments: dict[str, Any] | RawArguments
    id: str = ""

    def arguments_json(self) -> str:
        """The arguments as the OpenAI wire format carries them: one JSON string
        (``ensure_ascii=False``, key order kept)."""
        if isinstance(self.arguments, RawArguments):
            return self.arguments.text
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallParsed:
    """A complete, validated call; emitted once. ``index`` counts calls from 0."""

    index: int
    call: ToolCall


ParseEvent = ReasoningDelta | ContentDelta | ToolCallParsed

# "tool_calls" is the server's: a turn that ended with calls, whatever stopped it.
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]


@dataclass(frozen=True)
class Finished:
    """Last event of every generation that was not cancelled by the consumer."""

    finish_reason: FinishReason
    usage: Usage
    text: str  # the whole generated text, without the EOS marker or a matched stop string
    stop: str | None = None  # the stop string that ended the text, if one did


GenerationEvent = Admitted | TextDelta | ParseEvent | Finished


@dataclass(frozen=True)
class ParsedMessage:
    """A whole assistant turn as the parser split it."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

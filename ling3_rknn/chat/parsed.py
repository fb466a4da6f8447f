"""What the parsers produce: the assistant message and the streaming events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallParsed:
    """A complete, validated call; emitted once. ``index`` counts calls from 0."""

    index: int
    call: ToolCall


ParseEvent = ReasoningDelta | ContentDelta | ToolCallParsed

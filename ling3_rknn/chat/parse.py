"""Whole-text parsing of an assistant turn, and the OpenAI message a client gets back."""

from __future__ import annotations

import secrets
import string
from collections.abc import Sequence
from typing import Any

from .events import ParsedMessage, ToolCall
from .history import history_form
from .stream_parse import StreamingParser


def parse_assistant(
    text: str, tools: Any = None, *, thinking: bool = True, parallel_tool_calls: bool = True,
    calls_only_first: bool = False,
) -> ParsedMessage:
    """Generated text -> reasoning, content and calls (rules in ``stream_parse``)."""
    parser = StreamingParser(tools, thinking=thinking, parallel_tool_calls=parallel_tool_calls,
                             calls_only_first=calls_only_first)
    parser.feed(text)
    parser.finish()
    return parser.result()


def history_text(
    generated: str, tools: Any = None, *, thinking: bool = True, parallel_tool_calls: bool = True
) -> str | None:
    """``history.history_form`` of a whole generated text (for callers that did not
    stream it)."""
    parsed = parse_assistant(
        generated, tools, thinking=thinking, parallel_tool_calls=parallel_tool_calls
    )
    return history_form(parsed, thinking=thinking)


_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """``call_`` + 24 random alphanumerics: unique, and accepted by every client we know
    (some want only alphanumerics after the prefix)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def assistant_message(parsed: ParsedMessage, ids: Sequence[str] | None = None) -> dict:
    """The OpenAI assistant message for ``parsed``: what the server returns and what clients
    send back as history. ``content`` is null when there are calls and no text; arguments are
    a JSON string (``ensure_ascii=False``, key order kept); reasoning goes in
    ``reasoning_content`` and is omitted when empty."""
    if ids is not None and len(ids) != len(parsed.tool_calls):
        raise ValueError("one id per tool call")
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content if parsed.content or not parsed.tool_calls else None,
    }
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [
            openai_tool_call(call, ids[i] if ids is not None else new_tool_call_id())
            for i, call in enumerate(parsed.tool_calls)
        ]
    return msg


def openai_tool_call(call: ToolCall, call_id: str | None = None) -> dict[str, Any]:
    """One entry of an OpenAI ``tool_calls`` list (``call_id`` defaults to the call's own)."""
    return {
        "id": call.id if call_id is None else call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }

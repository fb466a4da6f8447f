"""The text a generated turn becomes when a client sends it back as history.

The template normalises an assistant turn when it re-renders it (reasoning is stripped of
surrounding newlines, content loses its leading newlines, arguments are re-serialised), so
the text the model generated and the text of the next request can differ even though the
client changed nothing. The engine keys its "reuse the ids the model generated" transcripts
by this canonical form, so an agent loop keeps hitting the prefix cache whatever spacing
the model chose.
"""

from __future__ import annotations

from typing import Any

from .parse import assistant_message, parse_assistant
from .render import render_text
from .segments import ChatFormatError

_END_OF_TURN = "<|role_end|>"
_ANCHOR = [{"role": "user", "content": "."}]


def history_text(
    generated: str, tools: Any = None, *, thinking: bool = True, parallel_tool_calls: bool = True
) -> str | None:
    """The re-rendered form of ``generated`` as the continuation of the generation prompt
    (without the end-of-turn marker), or None when the template would not reproduce the
    generation prompt for it (e.g. thinking off but the model wrote a reasoning block)."""
    parsed = parse_assistant(
        generated, tools, thinking=thinking, parallel_tool_calls=parallel_tool_calls
    )
    message = assistant_message(parsed, ids=[f"call_{i}" for i in range(len(parsed.tool_calls))])
    try:
        head = render_text(_ANCHOR, enable_thinking=thinking, add_generation_prompt=True)
        full = render_text(
            [*_ANCHOR, message], enable_thinking=thinking, add_generation_prompt=False
        )
    except ChatFormatError:
        return None
    if not full.startswith(head) or not full.endswith(_END_OF_TURN):
        return None
    return full[len(head) : -len(_END_OF_TURN)]

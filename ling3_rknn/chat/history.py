"""The text a generated turn becomes when a client sends it back as history.

The template normalises an assistant turn when it re-renders it (reasoning is stripped of
surrounding newlines, content loses its leading newlines, arguments are re-serialised), so
the text the model generated and the text of the next request can differ even though the
client changed nothing. The engine keys its "reuse the ids the model generated" transcripts
by this canonical form, so an agent loop keeps hitting the prefix cache whatever spacing
the model chose. The form is rendered from what the streaming parser already produced
(``StreamingParser.history_text``): no second parse, one render of the one turn.
"""

from __future__ import annotations

from .events import ParsedMessage
from .markers import ROLE_END, generation_prompt
from .normalize import NormalMessage
from .render import render_assistant_text
from .segments import ChatFormatError


def history_form(parsed: ParsedMessage, *, thinking: bool = True) -> str | None:
    """The re-rendered form of the turn ``parsed`` as the continuation of the generation
    prompt (without the end-of-turn marker), or None when the template would not reproduce
    the generation prompt for it (e.g. thinking off but the model wrote a reasoning block)."""
    if any(not call.name for call in parsed.tool_calls):
        return None  # a client could not send such a call back (normalize refuses it)
    message = NormalMessage(
        "assistant", parsed.content, parsed.reasoning or None, list(parsed.tool_calls)
    )
    try:
        turn = render_assistant_text(message)
    except ChatFormatError:
        return None
    head = generation_prompt(thinking)
    if not turn.startswith(head) or not turn.endswith(ROLE_END):
        return None
    return turn[len(head) : -len(ROLE_END)]


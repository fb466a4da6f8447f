"""The Bailing V3 format's special-token spellings, written down once.

The template writes them, the tokenizer maps them to control ids (and never produces them
from message text), the parser reads them in generated output and the engine and server stop
on the end-of-turn marker; all of them take the spelling from here (docs/serving.md
sections 1 to 4).
"""

from __future__ import annotations

from typing import Final

END_OF_TEXT: Final = "<|endoftext|>"
ROLE_END: Final = "<|role_end|>"  # ends every turn; the model's end-of-sequence token
# Opening and closing pairs.
ROLE_OPEN, ROLE_CLOSE = "<role>", "</role>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY_OPEN, ARG_KEY_CLOSE = "<arg_key>", "</arg_key>"
ARG_VALUE_OPEN, ARG_VALUE_CLOSE = "<arg_value>", "</arg_value>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# The special tokens an assistant turn may contain (reasoning and tool-call markup); the
# parser reads them. Any other special token in generated output ends the turn.
ANSWER_MARKERS: Final[tuple[str, ...]] = (
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    ARG_KEY_OPEN,
    ARG_KEY_CLOSE,
    ARG_VALUE_OPEN,
    ARG_VALUE_CLOSE,
)
# The markers of a call: the opening one and those that only belong inside a call. Where
# no call is possible none of them may be sampled; before a lazy call grammar is entered,
# only the opening one may (docs/serving.md 9).
CALL_BODY_MARKERS: Final[tuple[str, ...]] = (
    TOOL_CALL_CLOSE,
    ARG_KEY_OPEN,
    ARG_KEY_CLOSE,
    ARG_VALUE_OPEN,
    ARG_VALUE_CLOSE,
)
CALL_MARKERS: Final[tuple[str, ...]] = (TOOL_CALL_OPEN, *CALL_BODY_MARKERS)
# Every marker the template writes: never produced from TEXT, even where a tokenizer file
# marks one non-special (e.g. Qwen-style files mark <think> "special": false).
CONTROL_MARKERS: Final[tuple[str, ...]] = (
    END_OF_TEXT,
    ROLE_END,
    ROLE_OPEN,
    ROLE_CLOSE,
    *ANSWER_MARKERS,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
)


def role(name: str) -> str:
    """The header of a turn, e.g. ``<role>ASSISTANT</role>``."""
    return f"{ROLE_OPEN}{name}{ROLE_CLOSE}"


def generation_prompt(thinking: bool) -> str:
    """What the template writes to open the assistant's turn: thinking leaves ``<think>``
    open for the model, thinking off writes an empty reasoning block."""
    head = f"{role('ASSISTANT')}\n{THINK_OPEN}"
    return head if thinking else head + THINK_CLOSE


def spent_reasoning_markers(thinking: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(never sampled, sampled at most once) reasoning markers of an answer: the generation
    prompt opens the reasoning (``<think>``) and, with thinking off, closes it too, so the
    opening marker is never valid and the close is valid once, only with thinking on
    (docs/serving.md 9.1)."""
    if thinking:
        return (THINK_OPEN,), (THINK_CLOSE,)
    return (THINK_OPEN, THINK_CLOSE), ()

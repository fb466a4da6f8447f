"""Structural matcher for one ``<tool_call>`` block, usable on a growing prefix.

Grammar (docs/serving.md sections 2-3, llama.cpp's Ling 3 parser), after ``<tool_call>``:
``ws? NAME ws? ( <arg_key>KEY</arg_key> ws? <arg_value>VALUE</arg_value> ws? )* </tool_call>``.
NAME must be a declared tool; every required parameter must appear, in any order; a value
runs to the first ``</arg_value>``, so any other marker-like text inside it survives. A key the
schema does not declare is kept (typed as JSON if it parses, else text) rather than turning the
whole call into content: the client's own validation then tells the model what was wrong. An
empty or repeated key makes the block invalid (it is released as content, nothing is lost).
The answer for a prefix is monotone: once INVALID or a match, more text never changes it,
which is what keeps the streaming parser split-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from . import markers
from .events import ToolCall
from .tool_schema import ToolSpec, coerce_value

OPEN: Final = markers.TOOL_CALL_OPEN
CLOSE: Final = markers.TOOL_CALL_CLOSE
KEY_OPEN: Final = markers.ARG_KEY_OPEN
KEY_CLOSE: Final = markers.ARG_KEY_CLOSE
VALUE_OPEN: Final = markers.ARG_VALUE_OPEN
VALUE_CLOSE: Final = markers.ARG_VALUE_CLOSE


class _Verdict:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_MORE: Final = _Verdict("NEED_MORE")
# Waiting inside an <arg_value>: only a later "<" (of </arg_value>) can change the verdict.
NEED_MORE_IN_VALUE: Final = _Verdict("NEED_MORE_IN_VALUE")
INVALID: Final = _Verdict("INVALID")


@dataclass(frozen=True)
class CallMatch:
    call: ToolCall
    end: int  # characters consumed after the opening <tool_call>


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


def _name_end(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and not text[pos].isspace() and text[pos] != "<":
        pos += 1
    return pos


def match_call(text: str, tools: dict[str, ToolSpec], final: bool) -> CallMatch | _Verdict:
    """Match ``text`` (what follows ``<tool_call>``) against the call grammar."""
    pending = INVALID if final else NEED_MORE
    pos = _skip_ws(text, 0)
    if pos == len(text):
        return pending
    end = _name_end(text, pos)
    if end == len(text):
        partial = text[pos:]
        viable = any(name.startswith(partial) for name in tools)
        return pending if viable else INVALID
    spec = tools.get(text[pos:end])
    if spec is None:
        return INVALID
    args: dict = {}
    pos = _skip_ws(text, end)
    while True:
        if text.startswith(CLOSE, pos):
            if any(r not in args for r in spec.required):
                return INVALID
            return CallMatch(ToolCall(spec.name, args), pos + len(CLOSE))
        if text.startswith(KEY_OPEN, pos):
            start = pos + len(KEY_OPEN)
            close = text.find(KEY_CLOSE, start)
            if close < 0:
                return pending
            key = text[start:close]
            if not key or "<" in key or key in args:
                return INVALID
            pos = _skip_ws(text, close + len(KEY_CLOSE))
            if not text.startswith(VALUE_OPEN, pos):
                tail = text[pos:]
                return pending if VALUE_OPEN.startswith(tail) else INVALID
            start = pos + len(VALUE_OPEN)
            close = text.find(VALUE_CLOSE, start)
            if close < 0:
                return INVALID if final else NEED_MORE_IN_VALUE
            args[key] = coerce_value(text[start:close], spec.params.get(key, frozenset()))
            pos = _skip_ws(text, close + len(VALUE_CLOSE))
            continue
        rest = text[pos:]
        if CLOSE.startswith(rest) or KEY_OPEN.startswith(rest):
            return pending
        return INVALID


def cut_call(text: str, tools: dict[str, ToolSpec]) -> ToolCall | None:
    """The call a block cut short was writing (``text`` follows ``<tool_call>``): a declared
    name (whole, or the only one the text begins), the complete arguments and the one being
    written, its value as generated; None before any name. For a turn the grammar kept to
    valid calls (docs/serving.md 9), where a cut block is a call and never content."""
    pos = _skip_ws(text, 0)
    end = _name_end(text, pos)
    partial = text[pos:end]
    spec = tools.get(partial)
    if spec is None:
        started = [name for name in tools if partial and name.startswith(partial)]
        if end < len(text) or len(started) != 1:
            return None
        spec = tools[started[0]]
    args: dict = {}
    pos = _skip_ws(text, end)
    while text.startswith(KEY_OPEN, pos):
        start = pos + len(KEY_OPEN)
        close = text.find(KEY_CLOSE, start)
        if close < 0:
            break
        key = text[start:close]
        pos = _skip_ws(text, close + len(KEY_CLOSE))
        if not text.startswith(VALUE_OPEN, pos):
            break
        start = pos + len(VALUE_OPEN)
        close = text.find(VALUE_CLOSE, start)
        raw = text[start:] if close < 0 else text[start:close]
        if key and key not in args:
            args[key] = coerce_value(raw, spec.params.get(key, frozenset()))
        if close < 0:
            break
        pos = _skip_ws(text, close + len(VALUE_CLOSE))
    return ToolCall(spec.name, args)

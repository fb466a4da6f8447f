"""The Bailing V3 chat template (Ling-3.0-tiny), ported by hand to Python.

This is a line-by-line port of the official ``chat_template.jinja`` (sha256 below), not a
Jinja evaluation: the runtime must not depend on a template engine, and the trust boundary
needs the template's structure, which a rendered string no longer has. Every piece the
template writes itself is a CONTROL segment; every piece that came from the request
(message text, reasoning, tool names, argument keys and values, tool definitions) is TEXT.
The concatenated text is byte-identical to what transformers 5.24 renders from the official
file with HF's Jinja settings (``trim_blocks``, ``lstrip_blocks``, ``tojson`` =
``json.dumps(ensure_ascii=False)`` with default separators, key order kept); the goldens in
``tests/fixtures/chat/goldens.json`` are the judge.

Template facts the port reproduces (the surprising ones):

* thinking switch: ``detailed thinking on|off`` closes the first SYSTEM turn unless the
  system text already contains ``detailed thinking on`` or ``... off``;
* ``preserved_thinking`` is hard-wired to true, so every past assistant turn keeps its reasoning
  and the ``last_query_index`` computation has no effect on the output;
* reasoning comes from ``reasoning_content`` or from an inline ``<think>...</think>`` in content;
* a tool call is preceded by ``\\n`` if it is not the first or if the (unstripped) content is
  non-empty; non-string argument values are written with ``tojson(ensure_ascii=False)``;
* consecutive tool results share one OBSERVATION turn.
"""

from __future__ import annotations

import json
from typing import Any

from .events import RawArguments, ToolCall
from .markers import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    ROLE_END,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    generation_prompt,
    role,
)
from .normalize import NormalMessage, clean_text, normalize_messages, normalize_tools
from .segments import Segment

TEMPLATE_SHA256 = "eb6226c94ae38058f875d159f86a206b3a165828c0e7d6bda664ae14667f798a"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nIf none of the functions can be used, point it out. If the given question "
    "lacks the parameters required by the function, also point it out.\nIf you need to use a "
    "function, for each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n"
    "<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>\n"
)


class _Out:
    """Collects segments, merging neighbours of the same kind and dropping empty text."""

    def __init__(self) -> None:
        self._done: list[Segment] = []
        self._parts: list[str] = []
        self._control = True

    def c(self, text: str) -> None:
        self._add(text, True)

    def t(self, text: str) -> None:
        self._add(clean_text(text), False)

    def _add(self, text: str, control: bool) -> None:
        if not text:
            return
        if control != self._control:
            self._flush()
            self._control = control
        self._parts.append(text)

    def _flush(self) -> None:
        if self._parts:
            self._done.append(Segment("".join(self._parts), self._control))
            self._parts = []

    def segments(self) -> list[Segment]:
        self._flush()
        return self._done


def _has_thinking_flag(text: str) -> bool:
    return "detailed thinking on" in text or "detailed thinking off" in text


def _system_header(
    out: _Out, messages: list[NormalMessage], tools: list[dict], option: str
) -> None:
    first = messages[0]
    out.c(role("SYSTEM"))
    if tools:
        if first.role == "system":
            out.t(first.content)
            out.c("\n")
        out.c(TOOLS_PREAMBLE)
        for tool in tools:
            out.c("\n")
            out.t(json.dumps(tool, ensure_ascii=False))
        out.c(TOOLS_POSTAMBLE)
        if first.role == "system" and _has_thinking_flag(first.content):
            out.c(ROLE_END)
        else:
            out.c(f"detailed thinking {option}{ROLE_END}")
    elif first.role == "system":
        out.t(first.content)
        if _has_thinking_flag(first.content):
            out.c(ROLE_END)
        else:
            out.c(f"\ndetailed thinking {option}{ROLE_END}")
    else:
        out.c(f"detailed thinking {option}{ROLE_END}")


def _split_inline_reasoning(msg: NormalMessage) -> tuple[str, str]:
    """(reasoning, content) exactly as the template derives them."""
    content = msg.content
    if msg.reasoning:  # `is string and != ''`
        return msg.reasoning, content
    if THINK_CLOSE in content:
        reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
        return reasoning, content.split(THINK_CLOSE)[-1].lstrip("\n")
    return "", content


def _tool_call(out: _Out, call: ToolCall) -> None:
    out.c(TOOL_CALL_OPEN)
    out.t(call.name)
    out.c("\n")
    if isinstance(call.arguments, RawArguments):
        out.t(call.arguments.text)
    else:
        for key, value in call.arguments.items():
            out.c(ARG_KEY_OPEN)
            out.t(key)
            out.c(f"{ARG_KEY_CLOSE}\n{ARG_VALUE_OPEN}")
            out.t(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
            out.c(ARG_VALUE_CLOSE)
    out.c(f"\n{TOOL_CALL_CLOSE}")


def _assistant(out: _Out, msg: NormalMessage) -> None:
    reasoning, content = _split_inline_reasoning(msg)
    if reasoning:
        out.c(generation_prompt(thinking=True))
        out.t(reasoning.strip("\n"))
        out.c(THINK_CLOSE)
        out.t(content.lstrip("\n"))
    else:
        out.c(generation_prompt(thinking=False))
        out.t(content)
    for j, call in enumerate(msg.tool_calls):
        if j > 0 or content:
            out.c("\n")
        _tool_call(out, call)
    out.c(ROLE_END)


def render(
    messages: Any,
    tools: Any = None,
    *,
    enable_thinking: bool = True,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """OpenAI messages (+ tools) -> typed segments of the Bailing V3 prompt.

    Raises ChatFormatError (a ValueError) naming the message index/field it cannot render.
    """
    msgs = normalize_messages(messages)
    tool_list = normalize_tools(tools)
    option = "on" if enable_thinking else "off"
    out = _Out()
    _system_header(out, msgs, tool_list, option)
    last = len(msgs) - 1
    for i, msg in enumerate(msgs):
        if msg.role == "user":
            out.c(role("HUMAN"))
            out.t(msg.content)
            out.c(ROLE_END)
        elif msg.role == "system":
            if i > 0:
                out.c(role("SYSTEM"))
                out.t(msg.content)
                out.c(ROLE_END)
        elif msg.role == "assistant":
            _assistant(out, msg)
        else:  # tool
            if i == 0 or msgs[i - 1].role != "tool":
                out.c(role("OBSERVATION"))
            out.c(f"\n{TOOL_RESPONSE_OPEN}\n")
            out.t(msg.content)
            out.c(f"\n{TOOL_RESPONSE_CLOSE}")
            if i == last or msgs[i + 1].role != "tool":
                out.c(ROLE_END)
    if add_generation_prompt:
        out.c(generation_prompt(enable_thinking))
    return out.segments()


def render_assistant_text(message: NormalMessage) -> str:
    """One assistant turn as the template renders it inside a conversation, from its role
    header to its end-of-turn marker (``history`` needs no more than this)."""
    out = _Out()
    _assistant(out, message)
    return "".join(s.text for s in out.segments())


def render_text(messages: Any, tools: Any = None, **kwargs: Any) -> str:
    """The rendered prompt as one string (what the template would produce)."""
    return "".join(s.text for s in render(messages, tools, **kwargs))

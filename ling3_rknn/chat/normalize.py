"""OpenAI ``messages`` as received over HTTP -> the plain shapes the Bailing V3 template expects.

The template needs string contents, dict arguments and knows no ``developer`` role, so the
request is normalised first (docs/serving.md sections 1 and 7):

* ``developer`` -> ``system`` (the template would silently drop it).
* ``content``: ``None`` -> ``""``; a list of ``{"type": "text", "text": ...}`` parts is joined
  with ``"\\n"`` (what vLLM and llama.cpp do); ``refusal`` parts count as text on assistant
  messages; any other part type (images, audio, files) is a ChatFormatError.
* reasoning: ``reasoning_content``, else ``reasoning`` (the names clients echo back).
* tool call ``arguments``: a dict is used as is; a JSON string is decoded; an empty string or
  ``None`` means no arguments. A string that is not JSON, or JSON that is not an object,
  cannot be rendered by the template (it iterates ``arguments.items()``). Fallback: the call is
  kept and its raw string is written as the call body (``<tool_call>NAME\\nRAW\\n</tool_call>``),
  so the model still sees exactly what the client sent; nothing is invented or dropped.
* unpaired UTF-16 surrogates (``"\\ud83d"`` in the JSON, e.g. a JavaScript client that cut a
  tool output in the middle of an emoji) become U+FFFD, the character their bytes would decode
  to; left in, no tokenizer can encode them and the agent's turn would fail. The renderer
  applies ``clean_text`` to every TEXT piece it writes (tool JSON included), so this costs one
  UTF-8 check per piece on valid input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .events import RawArguments, ToolCall
from .segments import ChatFormatError

ROLES = {"system", "developer", "user", "assistant", "tool"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with unpaired surrogates replaced by U+FFFD (fast path: valid text as is)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


@dataclass(frozen=True)
class NormalMessage:
    role: str  # system | user | assistant | tool
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def _objects(items: list, where: str, hint: str = "") -> Iterator[tuple[str, dict]]:
    """(``where[i]``, item) for a list that must hold JSON objects only."""
    for i, item in enumerate(items):
        item_where = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ChatFormatError(f"{item_where} must be an object{hint}")
        yield item_where, item


def _content(msg: dict, where: str, role: str) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}.content must be a string, null or a list of text parts")
    texts = []
    allowed = {"text", "refusal"} if role == "assistant" else {"text"}
    for pwhere, part in _objects(content, f"{where}.content", " with a 'type'"):
        kind = part.get("type")
        if kind not in allowed:
            raise ChatFormatError(
                f"{pwhere}.type {kind!r} is not supported (this model reads text only)"
            )
        value = part.get(kind)
        if not isinstance(value, str):
            raise ChatFormatError(f"{pwhere}.{kind} must be a string")
        texts.append(value)
    return "\n".join(texts)


def _arguments(raw: Any, where: str) -> dict[str, Any] | RawArguments:
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise ChatFormatError(f"{where} must be a JSON string or an object")
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return RawArguments(raw)
    except RecursionError:  # nested past Python's stack: it cannot be rendered as keys
        raise ChatFormatError(f"{where} is nested too deeply") from None
    return value if isinstance(value, dict) else RawArguments(raw)


def _tool_calls(msg: dict, where: str) -> list[ToolCall]:
    calls = msg.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}.tool_calls must be a list")
    out = []
    for cwhere, call in _objects(calls, f"{where}.tool_calls"):
        fn = call.get("function") or call  # the template also accepts a bare {name, arguments}
        if not isinstance(fn, dict):
            raise ChatFormatError(f"{cwhere}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"{cwhere}.function.name must be a non-empty string")
        out.append(
            ToolCall(name, _arguments(fn.get("arguments"), f"{cwhere}.function.arguments"))
        )
    return out


def normalize_messages(messages: Any) -> list[NormalMessage]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out = []
    for where, msg in _objects(messages, "messages"):
        role = msg.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role {role!r} is not one of {sorted(ROLES)}")
        if role == "developer":
            role = "system"
        content = _content(msg, where, role)
        reasoning = None
        calls: list[ToolCall] = []
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                value = msg.get(key)
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise ChatFormatError(f"{where}.{key} must be a string")
                reasoning = value
                break
            calls = _tool_calls(msg, where)
        out.append(NormalMessage(role, content, reasoning, calls))
    return out


def normalize_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatFormatError(f"tools[{i}] must be an object")
    return tools

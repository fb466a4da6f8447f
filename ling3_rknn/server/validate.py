"""Strict schema for ``POST /v1/chat/completions``.

Every key is checked; an unknown one is a 400 naming it by its full path
(``messages[2].tool_calls[0].function.argumnets``), so a typo in a client config never
silently changes behaviour. The keys that real clients send and that we accept or ignore
are listed explicitly (docs/serving.md 6.2 and 7).

Written by hand rather than with pydantic on purpose: clients need error messages and a
``param`` in OpenAI's path notation, and pydantic's union errors name internal union
members (``content.list[TextPart].0.type``) that would leak into every message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ling3_rknn.engine.api import SamplingParams
from ling3_rknn.server.errors import ApiError, invalid_request, shown
from ling3_rknn.server.json_checks import (
    MAX_PARTS,
    Check,
    Invalid,
    any_object,
    array,
    boolean,
    check_depth,
    fail,
    integer,
    join,
    json_object,
    nullable,
    number,
    one_of,
    string,
    string_map,
    type_name,
)
from ling3_rknn.server.param_names import ParamNames

# Outside this range the penalty divides or multiplies logits past float range (1e-300
# made every logit infinite); the engine checks the same bounds (engine/sampler.py).
REPETITION_PENALTY = (0.01, 100.0)
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class ChatRequest:
    """A validated request, in the terms the completion pipeline needs."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str  # "auto", "none" or "required" (also for a named tool)
    parallel_tool_calls: bool
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    sampling: SamplingParams
    enable_thinking: bool
    forced_tool: str | None = None  # tool_choice names this tool
    allowed_tools: tuple[str, ...] | None = None  # tool_choice allowed_tools: callable subset
    response_schema: dict[str, Any] | None = None  # response_format's JSON schema
    # Where the parts came from in another API's body (None: the chat route's own names).
    names: ParamNames | None = None


# ---- messages ---------------------------------------------------------------------------


def _text_part(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict) and value.get("type") not in (None, "text"):
        fail(
            join(path, "type"),
            f"content part type {value.get('type')!r} is not supported: this model is text-only",
        )
    return json_object(value, path, {"type": one_of("text"), "text": string}, ("type", "text"))


def _content(value: Any, path: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return array(_text_part, max_items=MAX_PARTS)(value, path)
    fail(path, f"expected a string or an array of text parts, got {type_name(value)}")
    raise AssertionError("unreachable")


def _tool_call_arguments(value: Any, path: str) -> Any:
    # A JSON string (OpenAI) or an object (some clients); a string that is not JSON is
    # passed on: rejecting it would wedge an agent that replays its own broken call.
    if not isinstance(value, str | dict):
        fail(path, f"expected a JSON string or an object, got {type_name(value)}")
    return value


def _history_tool_call(value: Any, path: str) -> dict[str, Any]:
    function = {"name": tool_name, "arguments": _tool_call_arguments}
    return json_object(
        value,
        path,
        {
            "id": string,
            "type": one_of("function"),
            "function": lambda v, p: json_object(v, p, function, ("name",)),
            # The OpenAI SDK's stream helpers keep the chunk index on the calls they
            # assemble; agents append that message to the history as it is.
            "index": nullable(integer(0)),
        },
        ("function",),
    )


_MESSAGE_FIELDS: dict[str, dict[str, Check]] = {
    "system": {"role": string, "content": _content, "name": nullable(string)},
    "developer": {"role": string, "content": _content, "name": nullable(string)},
    "user": {"role": string, "content": _content, "name": nullable(string)},
    "assistant": {
        "role": string,
        "content": nullable(_content),
        "name": nullable(string),
        "refusal": nullable(string),
        "tool_calls": nullable(array(_history_tool_call)),
        "reasoning_content": nullable(string),
        "reasoning": nullable(string),
    },
    "tool": {
        "role": string,
        "content": _content,
        "tool_call_id": string,
        "name": nullable(string),
    },
}
_MESSAGE_REQUIRED = {
    "system": ("content",),
    "developer": ("content",),
    "user": ("content",),
    "assistant": (),
    "tool": ("content", "tool_call_id"),
}


def _message(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(path, f"expected a message object, got {type_name(value)}")
    if "role" not in value:
        fail(join(path, "role"), "this field is required")
    role = value["role"]
    if not isinstance(role, str) or role not in _MESSAGE_FIELDS:
        roles = ", ".join(repr(r) for r in _MESSAGE_FIELDS)
        fail(join(path, "role"), f"expected one of {roles}, got {role!r}")
    return json_object(value, path, _MESSAGE_FIELDS[role], _MESSAGE_REQUIRED[role])


# ---- tools ------------------------------------------------------------------------------


def tool_name(value: Any, path: str) -> str:
    """A tool name OpenAI's rule allows (every API's reader checks names with it, in
    declared tools and in the calls of a history alike: both reach the prompt)."""
    return _checked_name(value, path, "tool names")


def namespace_name(value: Any, path: str) -> str:
    """A Responses namespace: it becomes part of a tool name in the prompt (``ns__name``),
    so the same rule applies; the joined name is then at most 64 + 2 + 64 characters."""
    return _checked_name(value, path, "namespace names")


def _checked_name(value: Any, path: str, what: str) -> str:
    name = string(value, path)
    if not TOOL_NAME.match(name):
        fail(path, f"{what} must match {TOOL_NAME.pattern}, got {shown(name)}")
    return name


def _tool(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        fail(join(path, "type"), f"only 'function' tools are supported, got {value['type']!r}")
    function = {
        "name": tool_name,
        "description": nullable(string),
        "parameters": nullable(any_object),
        "strict": nullable(boolean),
    }
    return json_object(
        value,
        path,
        {"type": one_of("function"),
         "function": lambda v, p: json_object(v, p, function, ("name",))},
        ("type", "function"),
    )


def _tool_choice(value: Any, path: str) -> str | dict[str, Any]:
    """A mode ("auto", "none", "required"), ``{"name": ...}`` for a named tool, or
    ``{"mode": ..., "names": [...]}`` for OpenAI's ``allowed_tools``."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        # Entries may be whole tool definitions (the spec types them as objects): only the
        # name is read, the rest was already checked in "tools".
        named_tool = {"type": one_of("function"),
                      "function": lambda v, p: _function_name_of(v, p)}
        allowed = json_object(
            value, path,
            {"type": one_of("allowed_tools"),
             "allowed_tools": lambda v, p: json_object(
                 v, p, {"mode": one_of("auto", "required"),
                        "tools": array(lambda t, q: _allowed_entry(t, q, named_tool),
                                       min_items=1)},
                 ("mode", "tools"))},
            ("type", "allowed_tools"),
        )["allowed_tools"]
        return {"mode": allowed["mode"],
                "names": [t["function"]["name"] for t in allowed["tools"]]}
    if isinstance(value, dict):
        named = json_object(
            value, path,
            {"type": one_of("function"),
             "function": lambda v, p: json_object(v, p, {"name": tool_name}, ("name",))},
            ("type", "function"),
        )
        return {"name": named["function"]["name"]}
    fail(path, "expected 'auto', 'none', 'required', a function object or allowed_tools, "
               f"got {value!r}")
    raise AssertionError("unreachable")


def _allowed_entry(value: Any, path: str, fields: dict[str, Check]) -> dict[str, Any]:
    entry = any_object(value, path)
    return json_object({k: entry[k] for k in fields if k in entry}, path, fields,
                       ("type", "function"))


def _function_name_of(value: Any, path: str) -> dict[str, Any]:
    function = any_object(value, path)
    if "name" not in function:
        fail(join(path, "name"), "this field is required")
    return {"name": tool_name(function["name"], join(path, "name"))}


def _resolved_tool_choice(
    choice: str | dict[str, Any], tools: list[dict[str, Any]] | None
) -> tuple[str, str | None, tuple[str, ...] | None]:
    """(mode, forced tool name, allowed subset) once the tools are known."""
    names = {t["function"]["name"] for t in tools or ()}
    if isinstance(choice, dict) and "names" in choice:
        for i, name in enumerate(choice["names"]):
            if name not in names:
                fail(f"tool_choice.allowed_tools.tools[{i}].function.name",
                     f"{name!r} is not one of the declared tools")
        return choice["mode"], None, tuple(dict.fromkeys(choice["names"]))
    if isinstance(choice, dict):
        if choice["name"] not in names:
            fail("tool_choice.function.name",
                 f"{choice['name']!r} is not one of the declared tools")
        return "required", choice["name"], None
    if choice == "required" and not tools:
        fail("tool_choice", "'required' needs at least one tool in 'tools'")
    return choice, None, None


# ---- top level --------------------------------------------------------------------------


def _stop(value: Any, path: str) -> tuple[str, ...]:
    stops = (
        [value]
        if isinstance(value, str)
        else array(string, max_items=MAX_STOP_STRINGS)(value, path)
    )
    for i, stop in enumerate(stops):
        if not stop:
            fail(
                path if isinstance(value, str) else f"{path}[{i}]", "stop strings must not be empty"
            )
    return tuple(stops)


def _logprobs(value: Any, path: str) -> bool:
    if boolean(value, path):
        fail(path, "logprobs are not supported by this server")
    return False


def _top_logprobs(value: Any, path: str) -> int:
    if integer(0, 20)(value, path):
        fail(path, "logprobs are not supported by this server")
    return 0


def _response_format(value: Any, path: str) -> dict[str, Any] | None:
    """The content's JSON schema: None for "text", any object for "json_object"."""
    fields = json_object(
        value, path,
        {"type": one_of("text", "json_object", "json_schema"), "json_schema": any_object},
        ("type",),
    )
    kind = fields["type"]
    if kind != "json_schema" and "json_schema" in fields:
        fail(join(path, "json_schema"), f"only allowed with type 'json_schema', not {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if "json_schema" not in fields:
        fail(join(path, "json_schema"), "this field is required with type 'json_schema'")
    spec = json_object(
        fields["json_schema"], join(path, "json_schema"),
        {"name": schema_name, "description": nullable(string), "schema": nullable(any_object),
         "strict": nullable(boolean)},
        ("name",),
    )
    # Without a schema any JSON value is valid; the answer is constrained either way, so
    # "strict" changes nothing here.
    return spec.get("schema") or {}


def schema_name(value: Any, path: str) -> str:
    """A response format's schema name (the same rule as tool names)."""
    return _checked_name(value, path, "names")


_TOP_LEVEL: dict[str, Check] = {
    "model": string,
    "messages": array(_message, min_items=1),
    "stream": nullable(boolean),
    "stream_options": nullable(
        lambda v, p: json_object(v, p, {"include_usage": nullable(boolean)})),
    "max_tokens": nullable(integer(1)),
    "max_completion_tokens": nullable(integer(1)),
    "temperature": nullable(number(0.0, 2.0)),
    "top_p": nullable(number(0.0, 1.0, open_low=True)),
    "top_k": nullable(integer(0)),
    "min_p": nullable(number(0.0, 1.0)),
    "repetition_penalty": nullable(number(REPETITION_PENALTY[0], REPETITION_PENALTY[1])),
    "presence_penalty": nullable(number(-2.0, 2.0)),
    "frequency_penalty": nullable(number(-2.0, 2.0)),
    "seed": nullable(integer(0)),
    "stop": nullable(_stop),
    "n": nullable(integer(1, 1)),
    "tools": nullable(array(_tool)),
    "tool_choice": nullable(_tool_choice),
    "parallel_tool_calls": nullable(boolean),
    "reasoning_effort": nullable(one_of(*REASONING_EFFORTS)),
    # pi's qwen-chat-template mode also sends preserve_thinking; past reasoning is always
    # kept by the Ling template, so it is accepted and has nothing to change.
    "chat_template_kwargs": nullable(
        lambda v, p: json_object(
            v, p, {"enable_thinking": nullable(boolean), "preserve_thinking": nullable(boolean)}
        )
    ),
    "logprobs": nullable(_logprobs),
    "top_logprobs": nullable(_top_logprobs),
    "response_format": nullable(_response_format),
    # Accepted and ignored: clients send them on every request (pi and BFCL: store=false).
    "store": nullable(boolean),
    "metadata": nullable(string_map),
    "user": nullable(string),
    "safety_identifier": nullable(string),
    # OpenAI's prompt-cache hints (pi sends both with PI_CACHE_RETENTION=long). This
    # server's prefix cache keys on the tokens themselves, so neither changes what hits.
    "prompt_cache_key": nullable(string),
    "prompt_cache_retention": nullable(one_of("in-memory", "in_memory", "24h")),
}


def _thinking(fields: dict[str, Any]) -> bool:
    """Thinking is on unless turned off; the explicit template flag wins over the effort."""
    kwargs = fields.get("chat_template_kwargs") or {}
    if kwargs.get("enable_thinking") is not None:
        return bool(kwargs["enable_thinking"])
    return fields.get("reasoning_effort") != "none"


def _duplicatetool_names(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            fail(f"tools[{i}].function.name", f"duplicate tool name {name!r}")
        seen.add(name)


def _tool_results_answer_calls(messages: list[dict[str, Any]]) -> None:
    """A ``tool`` message answers a call of the assistant message before it (other tool
    results may sit between them), by the id the server gave that call; OpenAI refuses
    anything else, and the template would render an orphan result as if it answered."""
    calls: list[dict[str, Any]] = []
    answered: set[str] = set()
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role == "assistant":
            calls = msg.get("tool_calls") or []
            answered = set()
        elif role == "tool":
            if not calls:
                fail(f"messages[{i}]", "a 'tool' message must answer a tool call of the "
                                        "assistant message before it")
            ids = {c.get("id") for c in calls}
            call_id = msg["tool_call_id"]
            if None in ids:  # an id-less call: any id answers it
                continue
            if call_id in answered:
                fail(f"messages[{i}].tool_call_id",
                     f"{shown(call_id)} was already answered by an earlier 'tool' message")
            if call_id not in ids:
                fail(f"messages[{i}].tool_call_id",
                      f"{shown(call_id)} is not the id of a tool call of the "
                      "assistant message before it")
            answered.add(call_id)
        else:
            calls = []


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise ``ApiError`` (400) naming the offending param."""
    try:
        fields = json_object(body, "", _TOP_LEVEL, ("model", "messages"))
        _tool_results_answer_calls(fields["messages"])
        tools = fields.get("tools") or None
        if tools:
            _duplicatetool_names(tools)
        tool_choice, forced_tool, allowed_tools = _resolved_tool_choice(
            fields.get("tool_choice") or "auto", tools)
    except Invalid as exc:
        raise invalid_request(exc.message, exc.param) from None
    max_tokens = fields.get("max_completion_tokens") or fields.get("max_tokens")
    stream_options = fields.get("stream_options") or {}
    sampling = SamplingParams(
        temperature=fields.get("temperature"),
        top_p=fields.get("top_p"),
        top_k=fields.get("top_k"),
        min_p=fields.get("min_p"),
        repetition_penalty=fields.get("repetition_penalty"),
        presence_penalty=fields.get("presence_penalty"),
        frequency_penalty=fields.get("frequency_penalty"),
        seed=fields.get("seed"),
    )
    return ChatRequest(
        model=fields["model"],
        messages=fields["messages"],
        tools=tools,
        tool_choice=tool_choice,
        forced_tool=forced_tool,
        allowed_tools=allowed_tools,
        parallel_tool_calls=fields.get("parallel_tool_calls") is not False,
        stream=bool(fields.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        max_tokens=max_tokens,
        stop=fields.get("stop") or (),
        sampling=sampling,
        enable_thinking=_thinking(fields),
        response_schema=fields.get("response_format"),
    )


def require_object(body: Any) -> dict[str, Any]:
    """The decoded body, if it is an object nested no deeper than ``MAX_DEPTH``."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", param=None)
    try:
        check_depth(body)
    except Invalid as exc:
        raise invalid_request(exc.message, exc.param) from None
    return body

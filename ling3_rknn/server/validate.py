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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ling3_rknn.engine.api import SamplingParams
from ling3_rknn.server.errors import ApiError, invalid_request

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class ChatRequest:
    """A validated request, in the terms the completion pipeline needs."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str  # "auto" or "none"
    parallel_tool_calls: bool
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    sampling: SamplingParams
    enable_thinking: bool


class _Invalid(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


Check = Callable[[Any, str], Any]


def _fail(path: str, message: str) -> None:
    raise _Invalid(f"{path}: {message}" if path else message, path or None)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _object(
    value: Any,
    path: str,
    fields: Mapping[str, Check],
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Check an object's keys (unknown ones rejected by name) and each field's value."""
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {_type_name(value)}")
    for key in value:
        if key not in fields:
            where = _join(path, str(key))
            raise _Invalid(f"Unrecognized request argument supplied: {where}", where)
    for key in required:
        if key not in value:
            _fail(_join(path, key), "this field is required")
    return {key: fields[key](item, _join(path, key)) for key, item in value.items()}


def _nullable(check: Check) -> Check:
    def run(value: Any, path: str) -> Any:
        return None if value is None else check(value, path)

    return run


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {_type_name(value)}")
    return value


def _boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"expected a boolean, got {_type_name(value)}")
    return value


def _integer(low: int | None = None, high: int | None = None) -> Check:
    def run(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, f"expected an integer, got {_type_name(value)}")
        if low is not None and value < low:
            _fail(path, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            _fail(path, f"must be <= {high}, got {value}")
        return value

    return run


def _number(
    low: float | None = None, high: float | None = None, *, open_low: bool = False
) -> Check:
    def run(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(path, f"expected a number, got {_type_name(value)}")
        if value != value or value in (float("inf"), float("-inf")):
            _fail(path, "must be a finite number")
        if low is not None and (value <= low if open_low else value < low):
            _fail(path, f"must be {'>' if open_low else '>='} {low}, got {value}")
        if high is not None and value > high:
            _fail(path, f"must be <= {high}, got {value}")
        return float(value)

    return run


def _one_of(*choices: Any) -> Check:
    def run(value: Any, path: str) -> Any:
        if isinstance(value, bool) or value not in choices:
            options = ", ".join(repr(c) for c in choices)
            _fail(path, f"expected one of {options}, got {value!r}")
        return value

    return run


def _any_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {_type_name(value)}")
    return value


def _string_map(value: Any, path: str) -> dict[str, str]:
    value = _any_object(value, path)
    for key, item in value.items():
        _string(item, _join(path, key))
    return value


def _array(item: Check, *, min_items: int = 0, max_items: int | None = None) -> Check:
    def run(value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            _fail(path, f"expected an array, got {_type_name(value)}")
        if len(value) < min_items:
            _fail(path, f"expected at least {min_items} item(s)")
        if max_items is not None and len(value) > max_items:
            _fail(path, f"expected at most {max_items} items, got {len(value)}")
        return [item(element, f"{path}[{i}]") for i, element in enumerate(value)]

    return run


# ---- messages ---------------------------------------------------------------------------


def _text_part(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict) and value.get("type") not in (None, "text"):
        _fail(
            _join(path, "type"),
            f"content part type {value.get('type')!r} is not supported: this model is text-only",
        )
    return _object(value, path, {"type": _one_of("text"), "text": _string}, ("type", "text"))


def _content(value: Any, path: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _array(_text_part)(value, path)
    _fail(path, f"expected a string or an array of text parts, got {_type_name(value)}")
    raise AssertionError("unreachable")


def _tool_call_arguments(value: Any, path: str) -> Any:
    # A JSON string (OpenAI) or an object (some clients); a string that is not JSON is
    # passed on: rejecting it would wedge an agent that replays its own broken call.
    if not isinstance(value, str | dict):
        _fail(path, f"expected a JSON string or an object, got {_type_name(value)}")
    return value


def _history_tool_call(value: Any, path: str) -> dict[str, Any]:
    function = {"name": _string, "arguments": _tool_call_arguments}
    return _object(
        value,
        path,
        {
            "id": _string,
            "type": _one_of("function"),
            "function": lambda v, p: _object(v, p, function, ("name",)),
            # The OpenAI SDK's stream helpers keep the chunk index on the calls they
            # assemble; agents append that message to the history as it is.
            "index": _nullable(_integer(0)),
        },
        ("function",),
    )


_MESSAGE_FIELDS: dict[str, dict[str, Check]] = {
    "system": {"role": _string, "content": _content, "name": _nullable(_string)},
    "developer": {"role": _string, "content": _content, "name": _nullable(_string)},
    "user": {"role": _string, "content": _content, "name": _nullable(_string)},
    "assistant": {
        "role": _string,
        "content": _nullable(_content),
        "name": _nullable(_string),
        "refusal": _nullable(_string),
        "tool_calls": _nullable(_array(_history_tool_call)),
        "reasoning_content": _nullable(_string),
        "reasoning": _nullable(_string),
    },
    "tool": {
        "role": _string,
        "content": _content,
        "tool_call_id": _string,
        "name": _nullable(_string),
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
        _fail(path, f"expected a message object, got {_type_name(value)}")
    if "role" not in value:
        _fail(_join(path, "role"), "this field is required")
    role = value["role"]
    if not isinstance(role, str) or role not in _MESSAGE_FIELDS:
        roles = ", ".join(repr(r) for r in _MESSAGE_FIELDS)
        _fail(_join(path, "role"), f"expected one of {roles}, got {role!r}")
    return _object(value, path, _MESSAGE_FIELDS[role], _MESSAGE_REQUIRED[role])


# ---- tools ------------------------------------------------------------------------------


def _tool_name(value: Any, path: str) -> str:
    name = _string(value, path)
    if not TOOL_NAME.match(name):
        _fail(path, f"tool names must match {TOOL_NAME.pattern}, got {name!r}")
    return name


def _tool(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict) and value.get("type", "function") != "function":
        _fail(_join(path, "type"), f"only 'function' tools are supported, got {value['type']!r}")
    function = {
        "name": _tool_name,
        "description": _nullable(_string),
        "parameters": _nullable(_any_object),
        "strict": _nullable(_boolean),
    }
    return _object(
        value,
        path,
        {"type": _one_of("function"), "function": lambda v, p: _object(v, p, function, ("name",))},
        ("type", "function"),
    )


def _tool_choice(value: Any, path: str) -> str:
    if value in ("auto", "none"):
        return value
    if value == "required" or isinstance(value, dict):
        raise _Invalid(
            f"{path}: {value!r} is not supported yet (it needs constrained decoding); "
            "use 'auto' or 'none'",
            path,
        )
    _fail(path, f"expected 'auto' or 'none', got {value!r}")
    raise AssertionError("unreachable")


# ---- top level --------------------------------------------------------------------------


def _stop(value: Any, path: str) -> tuple[str, ...]:
    stops = (
        [value]
        if isinstance(value, str)
        else _array(_string, max_items=MAX_STOP_STRINGS)(value, path)
    )
    for i, stop in enumerate(stops):
        if not stop:
            _fail(
                path if isinstance(value, str) else f"{path}[{i}]", "stop strings must not be empty"
            )
    return tuple(stops)


def _logprobs(value: Any, path: str) -> bool:
    if _boolean(value, path):
        _fail(path, "logprobs are not supported by this server")
    return False


def _top_logprobs(value: Any, path: str) -> int:
    if _integer(0, 20)(value, path):
        _fail(path, "logprobs are not supported by this server")
    return 0


def _response_format(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict) and value.get("type") in ("json_object", "json_schema"):
        _fail(
            _join(path, "type"), f"{value['type']!r} needs constrained decoding, not supported yet"
        )
    return _object(value, path, {"type": _one_of("text")}, ("type",))


_TOP_LEVEL: dict[str, Check] = {
    "model": _string,
    "messages": _array(_message, min_items=1),
    "stream": _nullable(_boolean),
    "stream_options": _nullable(lambda v, p: _object(v, p, {"include_usage": _nullable(_boolean)})),
    "max_tokens": _nullable(_integer(1)),
    "max_completion_tokens": _nullable(_integer(1)),
    "temperature": _nullable(_number(0.0, 2.0)),
    "top_p": _nullable(_number(0.0, 1.0, open_low=True)),
    "top_k": _nullable(_integer(0)),
    "min_p": _nullable(_number(0.0, 1.0)),
    "repetition_penalty": _nullable(_number(0.0, None, open_low=True)),
    "presence_penalty": _nullable(_number(-2.0, 2.0)),
    "frequency_penalty": _nullable(_number(-2.0, 2.0)),
    "seed": _nullable(_integer()),
    "stop": _nullable(_stop),
    "n": _nullable(_integer(1, 1)),
    "tools": _nullable(_array(_tool)),
    "tool_choice": _nullable(_tool_choice),
    "parallel_tool_calls": _nullable(_boolean),
    "reasoning_effort": _nullable(_one_of(*REASONING_EFFORTS)),
    # pi's qwen-chat-template mode also sends preserve_thinking; past reasoning is always
    # kept by the Ling template, so it is accepted and has nothing to change.
    "chat_template_kwargs": _nullable(
        lambda v, p: _object(
            v, p, {"enable_thinking": _nullable(_boolean), "preserve_thinking": _nullable(_boolean)}
        )
    ),
    "logprobs": _nullable(_logprobs),
    "top_logprobs": _nullable(_top_logprobs),
    "response_format": _nullable(_response_format),
    # Accepted and ignored: clients send them on every request (pi and BFCL: store=false).
    "store": _nullable(_boolean),
    "metadata": _nullable(_string_map),
    "user": _nullable(_string),
    "safety_identifier": _nullable(_string),
    # OpenAI's prompt-cache hints (pi sends both with PI_CACHE_RETENTION=long). This
    # server's prefix cache keys on the tokens themselves, so neither changes what hits.
    "prompt_cache_key": _nullable(_string),
    "prompt_cache_retention": _nullable(_one_of("in-memory", "in_memory", "24h")),
}


def _thinking(fields: dict[str, Any]) -> bool:
    """Thinking is on unless turned off; the explicit template flag wins over the effort."""
    kwargs = fields.get("chat_template_kwargs") or {}
    if kwargs.get("enable_thinking") is not None:
        return bool(kwargs["enable_thinking"])
    return fields.get("reasoning_effort") != "none"


def _duplicate_tool_names(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            _fail(f"tools[{i}].function.name", f"duplicate tool name {name!r}")
        seen.add(name)


def _tool_results_answer_calls(messages: list[dict[str, Any]]) -> None:
    """A ``tool`` message answers a call of the assistant message before it (other tool
    results may sit between them), by the id the server gave that call; OpenAI refuses
    anything else, and the template would render an orphan result as if it answered."""
    calls: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role == "assistant":
            calls = msg.get("tool_calls") or []
        elif role == "tool":
            if not calls:
                _fail(f"messages[{i}]", "a 'tool' message must answer a tool call of the "
                                        "assistant message before it")
            ids = {c.get("id") for c in calls}
            if None not in ids and msg["tool_call_id"] not in ids:  # an id-less call: any
                _fail(f"messages[{i}].tool_call_id",
                      f"{msg['tool_call_id']!r} is not the id of a tool call of the "
                      "assistant message before it")
        else:
            calls = []


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body; raise ``ApiError`` (400) naming the offending param."""
    try:
        fields = _object(body, "", _TOP_LEVEL, ("model", "messages"))
        _tool_results_answer_calls(fields["messages"])
        tools = fields.get("tools") or None
        if tools:
            _duplicate_tool_names(tools)
    except _Invalid as exc:
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
        messages=body["messages"],
        tools=tools,
        tool_choice=fields.get("tool_choice") or "auto",
        parallel_tool_calls=fields.get("parallel_tool_calls") is not False,
        stream=bool(fields.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        max_tokens=max_tokens,
        stop=fields.get("stop") or (),
        sampling=sampling,
        enable_thinking=_thinking(fields),
    )


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", param=None)
    return body

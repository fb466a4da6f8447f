"""``POST /v1/responses`` body -> the one internal chat request (``validate.ChatRequest``).

Every key is checked and an unknown one is a 400 naming its path (``input[3].content``),
as on the chat route. Keys clients send that change nothing here are accepted by name
(docs/serving.md 10.1). ``previous_response_id`` is refused with the spec's error: this
server keeps no responses (clients such as Codex send ``store: false`` and the whole
history every turn, which is also what lets the prefix cache match).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ling3_rknn.engine.api import SamplingParams
from ling3_rknn.server.errors import invalid_request, shown
from ling3_rknn.server.json_checks import (
    Invalid,
    any_object,
    array,
    boolean,
    fail,
    integer,
    json_object,
    nullable,
    number,
    one_of,
    string,
    string_map,
    type_tag,
)
from ling3_rknn.server.responses_api.items import read_input
from ling3_rknn.server.responses_api.tools import ToolSet, read_tool_choice, read_tools
from ling3_rknn.server.validate import REASONING_EFFORTS, ChatRequest, schema_name

ENCRYPTED_REASONING = "reasoning.encrypted_content"
# `include` values: ours, plus those that only concern hosted tools this server skips.
_INCLUDABLE = (
    ENCRYPTED_REASONING, "web_search_call.action.sources", "web_search_call.results",
    "file_search_call.results", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "message.input_image.image_url",
)


@dataclass(frozen=True)
class ResponsesNotes:
    """What the writer needs besides the chat request: the fields a response echoes and
    how to name calls of namespaced tools."""

    echo: dict[str, Any]
    tools: ToolSet
    encrypted_reasoning: bool


def _format(value: Any, path: str) -> dict[str, Any]:
    kind = type_tag(value, path)
    if kind == "json_schema":
        return json_object(value, path, {
            "type": string, "name": schema_name, "schema": any_object,
            "description": nullable(string), "strict": nullable(boolean),
        }, ("type", "name", "schema"))
    return json_object(value, path, {"type": one_of("text", "json_object", "json_schema")},
                       ("type",))


def _text(value: Any, path: str) -> dict[str, Any]:
    return json_object(value, path, {
        "format": nullable(_format), "verbosity": nullable(one_of("low", "medium", "high")),
    })


def _reasoning(value: Any, path: str) -> dict[str, Any]:
    return json_object(value, path, {
        "effort": nullable(one_of(*REASONING_EFFORTS)),
        "summary": nullable(one_of("auto", "concise", "detailed", "none")),
        "generate_summary": nullable(one_of("auto", "concise", "detailed", "none")),
    })


def _refused(reason: str) -> Any:
    def run(value: Any, path: str) -> Any:
        if value not in (None, False):
            fail(path, reason)
        return value
    return run


def _previous_response(value: Any, path: str) -> None:
    if value is not None:
        raise Invalid(f"Previous response with id {shown(value)} not found. This server stores no "
                      "responses: send the whole conversation in 'input' (with "
                      "store: false).", path)


_TOP_LEVEL = {
    "model": string,
    "input": lambda v, p: v,  # checked item by item in read_input
    "instructions": nullable(string),
    "tools": lambda v, p: v,  # checked in read_tools
    "tool_choice": lambda v, p: v,  # checked in read_tool_choice
    "parallel_tool_calls": nullable(boolean),
    "stream": nullable(boolean),
    "stream_options": nullable(lambda v, p: json_object(
        v, p, {"include_obfuscation": nullable(boolean)})),
    "max_output_tokens": nullable(integer(1)),
    "temperature": nullable(number(0.0, 2.0)),
    "top_p": nullable(number(0.0, 1.0, open_low=True)),
    "top_logprobs": nullable(integer(0, 0)),
    "reasoning": nullable(_reasoning),
    "text": nullable(_text),
    "include": nullable(array(one_of(*_INCLUDABLE))),
    "previous_response_id": _previous_response,
    "store": nullable(boolean),
    "metadata": nullable(string_map),
    "user": nullable(string),
    "safety_identifier": nullable(string),
    "prompt_cache_key": nullable(string),
    "prompt_cache_retention": nullable(one_of("in-memory", "in_memory", "24h")),
    "client_metadata": nullable(any_object),
    "service_tier": nullable(one_of("auto", "default", "flex", "priority", "scale")),
    "truncation": nullable(one_of("disabled")),
    "background": _refused("background responses need stored responses, which this "
                           "server does not keep"),
    "conversation": _refused("conversations need stored responses, which this server does "
                             "not keep; send the whole history in 'input'"),
}


def _response_schema(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") or {"type": "text"}
    if fmt["type"] == "json_object":
        return {"type": "object"}
    if fmt["type"] == "json_schema":
        return fmt["schema"]
    return None


def read_responses_request(body: dict[str, Any]) -> tuple[ChatRequest, ResponsesNotes]:
    """Validate a decoded body; raise ``ApiError`` (400) naming the offending param."""
    try:
        fields = json_object(body, "", _TOP_LEVEL, ("model", "input"))
        tools = read_tools(fields.get("tools"))
        tool_choice, forced, allowed = read_tool_choice(fields.get("tool_choice"), tools)
        messages, names = read_input(fields["input"], fields.get("instructions"), tools)
    except Invalid as exc:
        raise invalid_request(exc.message, exc.param) from None
    reasoning = fields.get("reasoning") or {}
    request = ChatRequest(
        model=fields["model"],
        messages=messages,
        tools=tools.tools or None,
        tool_choice=tool_choice,
        forced_tool=forced,
        allowed_tools=allowed,
        parallel_tool_calls=fields.get("parallel_tool_calls") is not False,
        stream=bool(fields.get("stream")),
        include_usage=True,
        max_tokens=fields.get("max_output_tokens"),
        stop=(),
        sampling=SamplingParams(temperature=fields.get("temperature"),
                                top_p=fields.get("top_p")),
        enable_thinking=reasoning.get("effort") != "none",
        response_schema=_response_schema(fields.get("text")),
        names=names,
    )
    echo = {key: fields.get(key) for key in (
        "instructions", "max_output_tokens", "metadata", "temperature", "top_p", "user",
        "store", "prompt_cache_key", "safety_identifier", "service_tier")}
    echo["tools"] = body.get("tools") or []
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = request.parallel_tool_calls
    echo["reasoning"] = {"effort": reasoning.get("effort"),
                         "summary": reasoning.get("summary")}
    echo["text"] = {"format": ((fields.get("text") or {}).get("format") or {"type": "text"})}
    include = fields.get("include") or ()
    notes = ResponsesNotes(echo, tools, ENCRYPTED_REASONING in include)
    return request, notes

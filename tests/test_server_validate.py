"""The strict request schema: what clients really send passes, everything else is a 400
naming the offending key by its full path."""

from __future__ import annotations

import pytest

from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.validate import parse_chat_request

USER = {"role": "user", "content": "hi"}
TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        "strict": False,
    },
}


CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": f"call_{i}", "type": "function",
     "function": {"name": "read", "arguments": f'{{"path": "{i}.py"}}'}} for i in (1, 2)]}
RESULT_1 = {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}


def body(**extra):
    return {"model": "ling-3.0-tiny", "messages": [USER], **extra}


def rejected(payload) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat_request(payload)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def test_minimal_request_defaults():
    request = parse_chat_request(body())
    assert request.stream is False
    assert request.tool_choice == "auto"
    assert request.parallel_tool_calls is True
    assert request.enable_thinking is True
    assert request.max_tokens is None
    assert request.stop == ()
    assert request.include_usage is False


def test_pi_request_is_accepted():
    """The body pi sends (docs/serving.md section 7), replay included."""
    payload = {
        "model": "ling-3.0-tiny",
        "messages": [
            {"role": "developer", "content": "You are pi."},
            {"role": "user", "content": [{"type": "text", "text": "read a.py"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need to read",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"path": "a.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "store": False,
        "max_completion_tokens": 16384,
        "tools": [TOOL],
        "reasoning_effort": "medium",
        "temperature": 0.6,
    }
    request = parse_chat_request(payload)
    assert request.stream and request.include_usage
    assert request.max_tokens == 16384
    assert request.tools == [TOOL]
    assert request.messages == payload["messages"]
    assert request.sampling.temperature == 0.6


def test_opencode_request_is_accepted():
    payload = body(
        max_tokens=32000,
        stream=True,
        stream_options={"include_usage": True},
        tools=[TOOL],
        tool_choice="auto",
        parallel_tool_calls=True,
        user="u1",
        metadata={"session": "abc"},
        seed=7,
        stop=["END"],
        presence_penalty=0.5,
        frequency_penalty=0.1,
        top_p=0.95,
        chat_template_kwargs={"enable_thinking": False},
        response_format={"type": "text"},
        logprobs=False,
        n=1,
    )
    payload["messages"] = [
        {"role": "system", "content": "a"},
        {"role": "system", "content": "b"},
        USER,
        {"role": "assistant", "content": "x", "reasoning": "r"},
        USER,
    ]
    request = parse_chat_request(payload)
    assert request.enable_thinking is False
    assert request.stop == ("END",)
    assert request.sampling.seed == 7


def test_assistant_arguments_as_object_and_broken_json_are_passed_on():
    call = {"id": "c", "type": "function", "function": {"name": "read", "arguments": {"a": 1}}}
    broken = {"id": "d", "type": "function", "function": {"name": "read", "arguments": "{oops"}}
    messages = [USER, {"role": "assistant", "tool_calls": [call, broken]}]
    assert parse_chat_request(body(messages=messages)).messages[1]["tool_calls"] == [call, broken]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (body(foo=1), "foo"),
        (body(stream_options={"include_usage": True, "x": 1}), "stream_options.x"),
        (body(messages=[{"role": "user", "content": "hi", "extra": 1}]), "messages[0].extra"),
        (
            body(messages=[USER, {"role": "assistant", "content": "a", "thoughts": "t"}]),
            "messages[1].thoughts",
        ),
        (
            body(
                messages=[
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "args": "{}"}}
                        ],
                    },
                ]
            ),
            "messages[1].tool_calls[0].function.args",
        ),
        (body(tools=[{**TOOL, "cache": True}]), "tools[0].cache"),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "params": {}}}]),
            "tools[0].function.params",
        ),
        (body(chat_template_kwargs={"thinking": True}), "chat_template_kwargs.thinking"),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]),
            "messages[0].content[0].x",
        ),
    ],
)
def test_unknown_keys_are_rejected_by_path(payload, param):
    error = rejected(payload)
    assert error.param == param
    assert param in error.message
    assert "Unrecognized request argument" in error.message


@pytest.mark.parametrize(
    ("payload", "param", "fragment"),
    [
        ({"messages": [USER]}, "model", "required"),
        ({"model": "m"}, "messages", "required"),
        (body(messages=[]), "messages", "at least 1"),
        (body(messages="hi"), "messages", "array"),
        (body(messages=[{}]), "messages[0].role", "required"),
        (body(messages=[{"role": 3, "content": "x"}]), "messages[0].role", "expected one of"),
        (body(messages=[{"role": "function", "content": "x"}]), "messages[0].role", "function"),
        (body(messages=[{"role": "user"}]), "messages[0].content", "required"),
        (body(messages=[{"role": "user", "content": 5}]), "messages[0].content", "string"),
        (body(messages=[{"role": "user", "content": None}]), "messages[0].content", "string"),
        (
            body(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            ),
            "messages[0].content[0].type",
            "text-only",
        ),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id", "required"),
        (body(n=2), "n", "<= 1"),
        (body(stream="yes"), "stream", "boolean"),
        (body(temperature=3), "temperature", "<= 2"),
        (body(temperature="0.5"), "temperature", "number"),
        (body(top_p=0), "top_p", "> 0"),
        (body(max_tokens=0), "max_tokens", ">= 1"),
        (body(max_completion_tokens=1.5), "max_completion_tokens", "integer"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (body(stop=""), "stop", "empty"),
        (body(tool_choice="required"), "tool_choice", "at least one tool"),
        (
            body(tool_choice={"type": "function", "function": {"name": "write"}}, tools=[TOOL]),
            "tool_choice.function.name",
            "not one of the declared tools",
        ),
        (body(tool_choice={"type": "function", "function": {}}, tools=[TOOL]),
         "tool_choice.function.name", "required"),
        (body(tool_choice={"type": "custom", "function": {"name": "read"}}, tools=[TOOL]),
         "tool_choice.type", "expected one of"),
        (body(tool_choice="sometimes"), "tool_choice", "expected"),
        (body(tools=[{"type": "custom", "custom": {}}]), "tools[0].type", "function"),
        (
            body(tools=[{"type": "function", "function": {"name": "bad name"}}]),
            "tools[0].function.name",
            "must match",
        ),
        (body(tools=[TOOL, TOOL]), "tools[1].function.name", "duplicate"),
        (body(logprobs=True), "logprobs", "not supported"),
        (body(top_logprobs=2), "top_logprobs", "not supported"),
        (body(response_format={"type": "xml"}), "response_format.type", "expected one of"),
        (body(response_format={"type": "json_schema"}), "response_format.json_schema",
         "required"),
        (body(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
         "response_format.json_schema.name", "required"),
        (body(response_format={"type": "json_schema",
                               "json_schema": {"name": "a b", "schema": {}}}),
         "response_format.json_schema.name", "must match"),
        (body(response_format={"type": "json_schema",
                               "json_schema": {"name": "a", "schema": []}}),
         "response_format.json_schema.schema", "object"),
        (body(response_format={"type": "json_object", "json_schema": {"name": "a"}}),
         "response_format.json_schema", "only allowed"),
        (body(reasoning_effort="max"), "reasoning_effort", "expected one of"),
        (body(metadata={"a": 1}), "metadata.a", "string"),
        (body(parallel_tool_calls=1), "parallel_tool_calls", "boolean"),
        (body(prompt_cache_retention="forever"), "prompt_cache_retention", "expected one of"),
        (body(messages=[{"role": "tool", "tool_call_id": "call_1", "content": "r"}]),
         "messages[0]", "must answer a tool call"),
        (body(messages=[USER, {"role": "assistant", "content": "hi"},
                        {"role": "tool", "tool_call_id": "call_1", "content": "r"}]),
         "messages[2]", "must answer a tool call"),
        (body(messages=[USER, CALLS, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]),
         "messages[2].tool_call_id", "'call_9' is not the id"),
        (body(messages=[USER, CALLS, RESULT_1, USER, RESULT_1]),
         "messages[4]", "must answer a tool call"),
    ],
)
def test_invalid_values_name_the_param(payload, param, fragment):
    error = rejected(payload)
    assert error.param == param
    assert fragment in error.message


def test_thinking_switches():
    assert parse_chat_request(body(reasoning_effort="none")).enable_thinking is False
    assert parse_chat_request(body(reasoning_effort="high")).enable_thinking is True
    off = body(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="high")
    assert parse_chat_request(off).enable_thinking is False
    on = body(chat_template_kwargs={"enable_thinking": True}, reasoning_effort="none")
    assert parse_chat_request(on).enable_thinking is True


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat_request(body(max_tokens=5, max_completion_tokens=9)).max_tokens == 9
    assert parse_chat_request(body(max_tokens=5)).max_tokens == 5


def test_allowed_tools_restrict_the_callable_subset():
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "read"}}]}}
    request = parse_chat_request(body(tools=[TOOL], tool_choice=choice))
    assert (request.tool_choice, request.forced_tool, request.allowed_tools) == (
        "required", None, ("read",))
    bad = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "write"}}]}}
    error = rejected(body(tools=[TOOL], tool_choice=bad))
    assert error.param == "tool_choice.allowed_tools.tools[0].function.name"
    whole = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [TOOL]}}
    assert parse_chat_request(body(tools=[TOOL], tool_choice=whole)).allowed_tools == ("read",)
    empty = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}
    assert rejected(body(tools=[TOOL], tool_choice=empty)).param == (
        "tool_choice.allowed_tools.tools")


def test_a_grammar_turn_has_no_end_of_turn_stop_string():
    """Under a grammar free text cannot spell <|role_end|>, and a JSON string that does must
    not be cut; a forced call also drops the client's stop strings."""
    from ling3_rknn.chat import render
    from ling3_rknn.server.completion import generation_request

    def stops(**extra):
        request = parse_chat_request(body(stop=["END"], **extra))
        return generation_request(request, render(request.messages, request.tools)).stop

    assert stops() == ("END", "<|role_end|>")
    assert stops(response_format={"type": "json_object"}) == ("END",)
    assert stops(tools=[TOOL], tool_choice="required") == ()


def test_forced_tools_and_response_formats_resolve():
    named = parse_chat_request(body(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "read"}}))
    assert (named.tool_choice, named.forced_tool) == ("required", "read")
    required = parse_chat_request(body(tools=[TOOL], tool_choice="required"))
    assert (required.tool_choice, required.forced_tool) == ("required", None)
    assert parse_chat_request(body(response_format={"type": "text"})).response_schema is None
    assert parse_chat_request(
        body(response_format={"type": "json_object"})).response_schema == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = parse_chat_request(body(response_format={
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True, "description": "d"}}))
    assert strict.response_schema == schema
    anything = parse_chat_request(body(response_format={
        "type": "json_schema", "json_schema": {"name": "A"}}))
    assert anything.response_schema == {}


def test_tool_choice_none_and_null_tools():
    assert parse_chat_request(body(tools=None, tool_choice=None)).tools is None
    assert parse_chat_request(body(tools=[], tool_choice="none")).tool_choice == "none"
    assert parse_chat_request(body(parallel_tool_calls=False)).parallel_tool_calls is False


def test_tool_results_answer_the_calls_before_them():
    results = [RESULT_1, {"role": "tool", "tool_call_id": "call_2", "content": "print(2)"}]
    request = parse_chat_request(body(messages=[USER, CALLS, *results]))
    assert [m["role"] for m in request.messages] == ["user", "assistant", "tool", "tool"]
    no_ids = {"role": "assistant", "tool_calls": [{"function": {"name": "read"}}]}
    parse_chat_request(body(messages=[USER, no_ids, RESULT_1]))  # nothing to match against


def test_prompt_cache_hints_are_accepted():
    """pi with PI_CACHE_RETENTION=long sends both; OpenAI SDK users send safety_identifier."""
    request = parse_chat_request(body(prompt_cache_key="session-1", prompt_cache_retention="24h",
                                      safety_identifier="user-hash"))
    assert request.messages == [USER]


def test_history_calls_may_keep_the_stream_index():
    """`client.chat.completions.stream(...).get_final_completion()` messages carry each
    call's chunk index; agents send them back as history unchanged."""
    calls = {**CALLS, "tool_calls": [{**c, "index": i} for i, c in enumerate(CALLS["tool_calls"])]}
    parse_chat_request(body(messages=[USER, calls, RESULT_1]))
    bad = {**CALLS, "tool_calls": [{**CALLS["tool_calls"][0], "index": -1}]}
    assert rejected(body(messages=[USER, bad, RESULT_1])).param == "messages[1].tool_calls[0].index"


def test_the_validated_messages_travel_on_not_the_raw_body(monkeypatch):
    """The request carries what the checks returned, never the client's own lists: a check
    that rewrites a value is honoured, and a later change to the body changes nothing."""
    import ling3_rknn.server.validate as validate
    from ling3_rknn.server.json_checks import array

    def tagged(value, path):
        return {**validate._message(value, path), "checked": path}

    monkeypatch.setitem(validate._TOP_LEVEL, "messages", array(tagged, min_items=1))
    assert parse_chat_request(body()).messages == [{**USER, "checked": "messages[0]"}]
    monkeypatch.undo()

    payload = body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    request = parse_chat_request(payload)
    payload["messages"][0]["content"][0]["text"] = "changed"
    payload["messages"].append({"role": "nobody"})
    assert request.messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

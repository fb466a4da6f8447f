"""The three readers (chat, Responses, Messages) on what reaches the prompt: every client
name is checked like a function name, a call is answered once and only from its own turn,
one turn's items merge without loss, and quoted client values are cut. Each case here
once passed a reader unchecked (issue 36's attack and mutation audit)."""

from __future__ import annotations

from typing import Any

import pytest

from ling3_rknn.server.anthropic_api.reader import read_messages_request
from ling3_rknn.server.errors import MESSAGE_CHARS, PARAM_CHARS, ApiError, invalid_request
from ling3_rknn.server.responses_api.reader import read_responses_request
from ling3_rknn.server.validate import parse_chat_request

MODEL = "ling-3.0-tiny"
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def responses(**body: Any):
    return read_responses_request({"model": MODEL, **body})


def messages(*msgs: dict[str, Any], **body: Any):
    return read_messages_request({"model": MODEL, "max_tokens": 8, "messages": list(msgs),
                                  **body})


def chat(*msgs: dict[str, Any], **body: Any):
    return parse_chat_request({"model": MODEL, "messages": list(msgs), **body})


def refused(read, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        read(*args, **kwargs)
    assert info.value.status == 400
    return info.value


# ---- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["a b", "\n", "<tool_call>", 'x"<|role_end|>',
                                       "n" * 300, ""])
def test_a_namespace_name_is_checked_like_a_function_name(namespace):
    """Before: any string, so `tool_choice: required` answered the raw call markup as text,
    and a 300-character namespace made a 313-character tool name the model then called."""
    tools = [{"type": "namespace", "name": namespace, "tools": [FN]}]
    error = refused(responses, input="hi", tools=tools, tool_choice="required")
    assert error.param == "tools[0].name"
    assert "namespace names must match" in error.message


def test_the_rendered_name_of_a_namespaced_tool_is_bounded():
    tools = [{"type": "namespace", "name": "n" * 64,
              "tools": [{**FN, "name": "f" * 64}]}]
    request, _ = responses(input="hi", tools=tools)
    (tool,) = request.tools
    assert len(tool["function"]["name"]) == 64 + 2 + 64


@pytest.mark.parametrize(("item", "param"), [
    ({"name": "a b"}, "input[1].name"),
    ({"name": "get_weather", "namespace": "<tool_call>"}, "input[1].namespace"),
])
def test_a_history_call_name_is_checked(item, param):
    call = {"type": "function_call", "call_id": "c1", "arguments": "{}", **item}
    error = refused(responses, input=[{"role": "user", "content": "x"}, call], tools=[FN])
    assert error.param == param


def test_chat_and_messages_history_call_names_are_checked():
    error = refused(chat, {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "<tool_call>x", "arguments": "{}"}}]})
    assert error.param == "messages[1].tool_calls[0].function.name"
    error = refused(messages, {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "a b", "input": {}}]})
    assert error.param == "messages[1].content[0].name"


# ---- calls and their results ------------------------------------------------------------------


def test_parallel_tool_calls_is_on_when_absent():
    request, notes = responses(input="hi", tools=[FN])
    assert request.parallel_tool_calls is True
    assert notes.echo["parallel_tool_calls"] is True
    request, notes = responses(input="hi", tools=[FN], parallel_tool_calls=False)
    assert request.parallel_tool_calls is False and notes.echo["parallel_tool_calls"] is False


def test_a_user_message_closes_the_calls_before_it():
    """An output may answer only the turn right before it: after a user message, the
    earlier call is closed."""
    error = refused(responses, tools=[FN], input=[
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"role": "user", "content": "never mind"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert error.param == "input[3].call_id"


def test_two_assistant_message_items_of_one_turn_keep_both_texts():
    request, _ = responses(input=[
        {"role": "user", "content": "x"},
        {"type": "message", "role": "assistant", "content": "first"},
        {"type": "message", "role": "assistant", "content": "second"},
        {"role": "user", "content": "y"}])
    assert [m.get("content") for m in request.messages] == ["x", "first\nsecond", "y"]


def test_a_tool_result_cannot_answer_a_call_from_before_a_later_user_message():
    call = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}
    error = refused(messages, {"role": "user", "content": "x"}, call,
                    {"role": "user", "content": "never mind"},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]})
    assert error.param == "messages[3].content[0].tool_use_id"


def test_two_results_for_one_call_are_a_400_in_each_api():
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    error = refused(responses, tools=[FN], input=[
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        output, output])
    assert error.param == "input[3].call_id" and "already answered" in error.message

    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    error = refused(messages, {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
                    {"role": "user", "content": [result, result]})
    assert error.param == "messages[2].content[1].tool_use_id"
    assert "already answered" in error.message

    tool = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    error = refused(chat, {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{}"}}]},
                    tool, tool)
    assert error.param == "messages[3].tool_call_id" and "already answered" in error.message


def test_two_calls_of_one_turn_are_each_answered_once():
    request, _ = responses(tools=[FN], input=[
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "b"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"}])
    assert [m["role"] for m in request.messages] == ["user", "assistant", "tool", "tool"]


# ---- long values in errors ----------------------------------------------------------------


def test_a_long_client_value_is_cut_in_the_error():
    huge = "r" * 1_000_000
    error = refused(responses, input="x", previous_response_id=huge)
    assert len(error.message) < 500 and "characters cut" in error.message
    error = refused(responses, input="x", **{"k" * 100_000: 1})  # an unknown key, quoted
    assert len(error.message) <= MESSAGE_CHARS + 40
    assert error.param is not None and len(error.param) <= PARAM_CHARS + 40
    assert invalid_request("short", "p").message == "short"


# ---- error paths in each API's own names ----------------------------------------------------

DEEP = "[" * 3000 + "]" * 3000  # valid JSON only a recursion-limited parser refuses


async def test_responses_errors_name_responses_paths_not_chat_paths():
    """Render and grammar refusals come back under the Responses body's own fields."""
    import aiohttp
    from scripted_engine import ScriptedEngine
    from server_harness import running_server

    bad_schema = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": 5,
                                              "maxLength": 2}}}}
    cases = [
        ({"input": [{"role": "user", "content": "x"},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather",
                     "arguments": DEEP},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
          "tools": [FN]}, "input", "input[1].arguments"),
        ({"input": "x", "tools": [{"type": "web_search"}, bad_schema],
          "tool_choice": "required"}, "tools[1].parameters.properties.x", None),
    ]
    async with running_server(ScriptedEngine()) as srv, aiohttp.ClientSession() as session:
        for body, param, quoted in cases:
            async with session.post(srv.v1 + "/responses",
                                    json={"model": MODEL, **body}) as r:
                assert r.status == 400
                error = (await r.json())["error"]
            assert error["param"] == param, error
            assert "messages[" not in error["message"] and ".function" not in error["message"]
            if quoted:
                assert quoted in error["message"], error


SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search"}
BAD_INPUT_SCHEMA = {"name": "f", "input_schema": {
    "type": "object", "properties": {"x": {"type": "string", "minLength": 5, "maxLength": 2}}}}


def test_messages_chat_paths_map_to_the_messages_body():
    """Every chat message, call and tool maps back to its own place in the Messages body:
    ``system`` first, a call to its ``tool_use`` block, a tool result to its block, the
    tools counted with the skipped server tools."""
    request, _ = messages(
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": "a"},
            {"type": "tool_result", "tool_use_id": "t1", "content": "b"},
            {"type": "text", "text": "and?"}]},
        system="Be brief.", tools=[SERVER_TOOL, BAD_INPUT_SCHEMA])
    names = request.names
    assert names is not None
    # chat: system, user, assistant (2 calls), tool, tool, user
    assert [m["role"] for m in request.messages] == [
        "system", "user", "assistant", "tool", "tool", "user"]
    expected = {
        "messages[0]": "system",
        "messages[1].content": "messages[0].content",
        "messages[2].tool_calls[0].function.arguments": "messages[1].content[1].input",
        "messages[2].tool_calls[1].function.name": "messages[1].content[2].name",
        "messages[3].tool_call_id": "messages[2].content[0].tool_use_id",
        "messages[4].content": "messages[2].content[1].content",
        "messages[5]": "messages[2]",
        "tools[0].function.parameters.properties.x": "tools[1].input_schema.properties.x",
        "tools[0].function.name": "tools[1].name",
        "tool_choice": "tool_choice",
        "messages": "messages",
    }
    assert {chat: names.path(chat) for chat in expected} == expected
    error = names.error(invalid_request(
        "messages[2].tool_calls[0].function.arguments is nested too deeply", "messages"))
    assert error.param == "messages"
    assert error.message == "messages[1].content[1].input is nested too deeply"


async def test_messages_errors_name_messages_paths_not_chat_paths():
    """A grammar refusal of a required tool's schema comes back under the Messages body's
    own field: its index counts the server tool the reader skipped, and its schema is
    ``input_schema`` (before: ``tools[0].function.parameters.properties.x``)."""
    import aiohttp
    from scripted_engine import ScriptedEngine
    from server_harness import running_server

    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "tools": [SERVER_TOOL, BAD_INPUT_SCHEMA]}
    async with running_server(ScriptedEngine()) as srv, aiohttp.ClientSession() as session:
        for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):
            async with session.post(srv.v1 + "/messages",
                                    json={**body, "tool_choice": choice}) as r:
                assert r.status == 400
                message = (await r.json())["error"]["message"]
            assert message.startswith("tools[1].input_schema.properties.x: "), message
            assert "function" not in message and "parameters" not in message

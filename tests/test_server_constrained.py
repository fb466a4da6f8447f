"""Constrained decoding end to end with no test double: the embedded demo model behind the
real server, driven by the official openai SDK: a named tool, ``"required"``,
``parallel_tool_calls: false`` and ``response_format`` from a Pydantic model via
``client.chat.completions.parse`` / ``.stream``, non-stream and stream."""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import running_server
from test_demo_agent import TOOLS

from ling3_rknn.demo import DEMO_MODEL_ID, load_demo_engine

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class CityReport(BaseModel):
    """Bounded fields: the demo model never learnt JSON, the grammar still makes it close."""

    city: str = Field(max_length=16)
    temperature_c: int = Field(ge=-60, le=60)
    sunny: bool


@pytest.fixture(scope="module")
def demo_engine():
    engine = load_demo_engine()
    yield engine
    engine.close()


@pytest.fixture
async def client(demo_engine):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            yield client
        finally:
            await client.close()


async def complete(client, stream: bool, **kwargs):
    """One chat completion, assembled by the SDK when streamed."""
    kwargs = {"model": DEMO_MODEL_ID, "max_tokens": 96, **kwargs}
    if not stream:
        return await client.chat.completions.create(**kwargs)
    async with client.chat.completions.stream(**kwargs) as events:
        async for _ in events:
            pass
        return await events.get_final_completion()


def valid_calls(message, allowed: set[str]) -> list:
    for call in message.tool_calls or []:
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, {**SCHEMAS[call.function.name],
                                        "additionalProperties": False})
    return message.tool_calls or []


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])


@STREAMS
async def test_named_tool_overrides_the_models_choice(client, stream):
    """The demo model would answer a weather question with get_weather; naming get_time
    forces that tool, and the model still fills the city it was asked about."""
    done = await complete(
        client, stream, tools=TOOLS,
        messages=[{"role": "user", "content": "What's the weather like in Lisbon?"}],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = valid_calls(choice.message, {"get_time"})
    assert json.loads(call.function.arguments) == {"city": "Lisbon"}


@STREAMS
async def test_required_makes_small_talk_call_a_tool(client, stream):
    """Unconstrained, the demo answers small talk in words (test_demo_agent); "required"
    turns the same request into calls of declared tools with valid arguments."""
    done = await complete(
        client, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Hello! Who are you?"}],
    )
    choice = done.choices[0]
    if choice.finish_reason == "length":  # a free string the model did not close
        pytest.fail(f"the forced call did not finish in 96 tokens: {choice.message}")
    assert choice.finish_reason == "tool_calls"
    assert len(valid_calls(choice.message, set(SCHEMAS))) == 1


@STREAMS
async def test_parse_with_a_pydantic_model(client, stream):
    messages = [{"role": "user", "content": "Report the weather in Paris as JSON."}]
    if stream:
        async with client.chat.completions.stream(
            model=DEMO_MODEL_ID, messages=messages, response_format=CityReport, max_tokens=96,
        ) as events:
            async for _ in events:
                pass
            done = await events.get_final_completion()
    else:
        done = await client.chat.completions.parse(
            model=DEMO_MODEL_ID, messages=messages, response_format=CityReport, max_tokens=96)
    message = done.choices[0].message
    assert isinstance(message.parsed, CityReport), message
    assert CityReport.model_validate_json(message.content) == message.parsed


async def test_json_object_mode(client):
    done = await complete(client, False, response_format={"type": "json_object"},
                          messages=[{"role": "user", "content": "Give me an object."}],
                          max_tokens=200)
    choice = done.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an unbounded object may run to max_tokens; it is still a JSON prefix
        assert choice.message.content.startswith("{")


class GetWeather(BaseModel):
    city: str = Field(description="The city name, e.g. Paris", max_length=24)


async def test_parse_with_a_strict_pydantic_function_tool(client):
    """openai.pydantic_function_tool declares ``strict: true``: under plain "auto" the call
    is constrained, and the SDK parses its arguments into the model."""
    done = await client.chat.completions.parse(
        model=DEMO_MODEL_ID, max_tokens=96,
        messages=[{"role": "user", "content": "What's the weather like in Lisbon?"}],
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather",
                                             description="Get the current weather in a city.")],
    )
    (call,) = done.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetWeather(city="Lisbon")


@pytest.mark.parametrize(("extra", "part", "keyword"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "integer"}}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.properties.x", "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "array", "contains": {"type": "integer"}}}}},
     "response_format.json_schema.schema", "contains"),
])
async def test_a_schema_the_library_cannot_serve_is_400_naming_it(client, extra, part, keyword):
    """Never a 500 and never an unconstrained answer: llguidance's refusal, with the part
    of the request its grammar rule came from."""
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=DEMO_MODEL_ID, messages=[{"role": "user", "content": "hi"}], **extra)
    message = info.value.body["message"]
    assert part in message and keyword in message
    assert info.value.body["param"] == part


async def test_the_librarys_refusal_names_the_messages_field(demo_engine):
    """The engine's compile error through /v1/messages names the Messages body's own tool
    (its index counting the server tool the reader skipped, ``input_schema``), never the
    chat form the request was rendered through (``tools[0].function.parameters``)."""
    body = {"model": DEMO_MODEL_ID, "max_tokens": 8, "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search"},
                      {"name": "f", "input_schema": {"type": "object", "properties": {
                          "x": {"not": {"type": "integer"}}}}}]}
    async with (running_server(demo_engine) as srv, aiohttp.ClientSession() as session,
                session.post(srv.v1 + "/messages", json=body) as r):
        assert r.status == 400
        message = (await r.json())["error"]["message"]
    assert message.startswith("tools[1].input_schema.properties.x"), message
    assert "not" in message and "function" not in message and "parameters" not in message


async def test_stop_strings_do_not_cut_a_forced_call(client):
    """A stop string the call itself contains ("\\n" is in every call, "city" is a key)
    would end the turn inside the block; a forced call is complete anyway."""
    done = await complete(
        client, False, tools=TOOLS, stop=["\n", "city"], reasoning_effort="none",
        messages=[{"role": "user", "content": "What time is it in Rome?"}],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert len(valid_calls(choice.message, {"get_time"})) == 1


@STREAMS
async def test_allowed_tools_required_calls_only_the_listed_tool(client, stream):
    """OpenAI's allowed_tools keeps every tool in the prompt (and the prefix cache) but
    lets the model call only the listed ones."""
    done = await complete(
        client, stream, tools=TOOLS,
        messages=[{"role": "user", "content": "What's the weather like in Lisbon?"}],
        tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "get_time"}}]}},
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in valid_calls(choice.message, {"get_time"})] == ["get_time"]


async def test_metrics_count_constrained_completions(demo_engine):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            await complete(client, False, tools=TOOLS,
                           messages=[{"role": "user", "content": "Time in Oslo?"}],
                           tool_choice={"type": "function", "function": {"name": "get_time"}})
            await complete(client, False, tools=TOOLS, max_tokens=8,
                           messages=[{"role": "user", "content": "Hi"}])
        finally:
            await client.close()
        async with aiohttp.ClientSession() as session, session.get(
                srv.base + "/metrics") as response:
            text = await response.text()
    assert 'ling3_constrained_completions_total{kind="named"} 1.0' in text
    assert 'kind="required"' not in text

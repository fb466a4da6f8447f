"""The embedded demo model behind the Responses and Anthropic Messages routes, with no test
double: the official ``openai`` SDK (``responses.create`` / ``.stream`` / ``.parse``), the
official ``anthropic`` SDK (``messages.create`` / ``.stream``) and the OpenAI Agents SDK's
default (Responses) model run whole tool loops; turn 2 of each must come from the prefix
cache, which only happens when the reader re-renders turn 1 byte for byte.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import running_server

from ling3_rknn.demo import DEMO_MODEL_ID, load_demo_engine

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "description": "The city name, e.g. Paris"}},
               "required": ["city"]}}
RESULT = "18 degrees C, sunny"


@pytest.fixture(scope="module")
def demo_engine():
    engine = load_demo_engine()
    yield engine
    engine.close()


async def _responses_turn(client: openai.AsyncOpenAI, items: list, stream: bool):
    kwargs = {"model": DEMO_MODEL_ID, "input": items, "store": False,
              "tools": [{"type": "function", **WEATHER}],
              "include": ["reasoning.encrypted_content"]}
    if not stream:
        return await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as events:
        async for _ in events:
            pass
        return await events.get_final_response()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_responses_tool_loop(demo_engine, stream):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            items: list = [{"role": "user", "content": "What's the weather like in Lisbon?"}]
            first = await _responses_turn(client, items, stream)
            (call,) = [o for o in first.output if o.type == "function_call"]
            assert call.name == "get_weather"
            assert json.loads(call.arguments) == {"city": "Lisbon"}
            # What Codex sends back: every output item as received, then the result.
            items += [o.model_dump(exclude_none=True) for o in first.output]
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": RESULT})
            second = await _responses_turn(client, items, stream)
        finally:
            await client.close()
    assert "18" in second.output_text
    turn1 = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= turn1


async def test_responses_parse_json_schema(demo_engine):
    # The demo was never taught JSON answers: inside the grammar it may write a string
    # that never ends, so the schema bounds it (maxLength) and the JSON always closes.
    # Unbounded, a response_format string runs to max_output_tokens and the answer is
    # "incomplete" (finish "length"), as OpenAI's is; only forced calls' raw strings get
    # a budget bound (docs/serving.md 9.1).
    class Verdict(BaseModel):
        answer: str = Field(max_length=60)
        sunny: bool

    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            parsed = await client.responses.parse(
                model=DEMO_MODEL_ID, input="Is it sunny in Lisbon? Answer as JSON.",
                text_format=Verdict, reasoning={"effort": "none"}, max_output_tokens=200)
        finally:
            await client.close()
    assert isinstance(parsed.output_parsed, Verdict)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_messages_tool_loop(demo_engine, stream):
    tool = {"name": WEATHER["name"], "description": WEATHER["description"],
            "input_schema": WEATHER["parameters"]}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    async with running_server(demo_engine) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.base, api_key="none", max_retries=0)

        async def turn(messages: list):
            kwargs = {"model": DEMO_MODEL_ID, "max_tokens": 256, "messages": messages,
                      "tools": [tool], "thinking": thinking}
            if not stream:
                return await client.messages.create(**kwargs)
            async with client.messages.stream(**kwargs) as events:
                async for _ in events:
                    pass
                return await events.get_final_message()

        try:
            messages: list = [{"role": "user", "content": "What's the weather like in Lisbon?"}]
            first = await turn(messages)
            assert first.stop_reason == "tool_use"
            (call,) = [b for b in first.content if b.type == "tool_use"]
            assert (call.name, call.input) == ("get_weather", {"city": "Lisbon"})
            messages += [
                {"role": "assistant",
                 "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": RESULT}]},
            ]
            second = await turn(messages)
        finally:
            await client.close()
    assert second.stop_reason == "end_turn"
    assert "18" in "".join(b.text for b in second.content if b.type == "text")
    turn1 = (first.usage.input_tokens + first.usage.cache_read_input_tokens
             + first.usage.output_tokens)
    assert second.usage.cache_read_input_tokens >= turn1


async def test_agents_sdk_default_model_with_a_function_tool(demo_engine):
    """The OpenAI Agents SDK with its default model provider (``OpenAIProvider``, which
    serves a model name through the Responses API), given only a client pointing at this
    server."""
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return RESULT

    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        agents.set_tracing_disabled(True)
        try:
            agent = agents.Agent(name="weather", tools=[get_weather], model=DEMO_MODEL_ID)
            provider = agents.OpenAIProvider(openai_client=client)
            assert isinstance(provider.get_model(DEMO_MODEL_ID), agents.OpenAIResponsesModel)
            result = await agents.Runner.run(
                agent, "What's the weather like in Lisbon?",
                run_config=agents.RunConfig(model_provider=provider))
        finally:
            await client.close()
    assert calls == ["Lisbon"]
    assert "18" in result.final_output

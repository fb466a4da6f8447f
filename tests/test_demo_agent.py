"""The embedded demo model as an agent, end to end with no test double: the shipped bundle
(loaded the way ``ling3-rknn serve`` loads it with no model flag), the real engine and
server, and the official openai SDK running a whole tool loop over HTTP.

The model is the trained demo (greedy by its generation config), so these tests pin its
behaviour on a few questions: a regression in the model, the converter, the runtime or
the protocol shows up as a wrong or missing call, not only as an error.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from server_harness import running_server

from ling3_rknn.chat import Segment
from ling3_rknn.demo import DEMO_MODEL_ID, load_demo_engine

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current local time in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"]}}},
]
STUB_RESULTS = {"get_weather": "18 degrees C, sunny", "get_time": "14:05"}


def run_tool(name: str, arguments: str) -> str:
    """The local stub the agent executes: it checks the arguments are what was asked."""
    assert json.loads(arguments).keys() == {"city"}
    return STUB_RESULTS[name]


@pytest.fixture(scope="module")
def demo_engine():
    engine = load_demo_engine()
    yield engine
    engine.close()


async def _complete(client: openai.AsyncOpenAI, messages: list, stream: bool):
    if not stream:
        return await client.chat.completions.create(
            model=DEMO_MODEL_ID, messages=messages, tools=TOOLS)
    async with client.chat.completions.stream(
        model=DEMO_MODEL_ID, messages=messages, tools=TOOLS,
        stream_options={"include_usage": True},
    ) as events:
        async for _ in events:
            pass
        return await events.get_final_completion()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize(("question", "tool", "city"), [
    ("What's the weather like in Lisbon?", "get_weather", "Lisbon"),
    ("What time is it in New York?", "get_time", "New York"),
    # What a newcomer types first (issue 26: the first demo miscopied each).
    ("What's the weather like in Paris?", "get_weather", "Paris"),
    ("What time is it in Tokyo?", "get_time", "Tokyo"),
    ("weather in London please", "get_weather", "London"),
])
async def test_tool_loop_with_the_openai_sdk(demo_engine, stream, question, tool, city):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            messages = [{"role": "user", "content": question}]
            first = await _complete(client, messages, stream)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            (call,) = choice.message.tool_calls
            assert call.function.name == tool
            assert json.loads(call.function.arguments) == {"city": city}
            result = run_tool(call.function.name, call.function.arguments)
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result},
            ]
            second = await _complete(client, messages, stream)
        finally:
            await client.close()
    answer = second.choices[0]
    assert answer.finish_reason == "stop"
    assert not answer.message.tool_calls
    for part in result.split(", "):
        assert part.split(" ")[0] in answer.message.content
    # Turn 2 evaluates only what is new: the whole turn-1 conversation (its prompt and the
    # call the model generated) comes from the prefix cache.
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= turn1


async def test_small_talk_gets_no_call(demo_engine):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            done = await client.chat.completions.create(
                model=DEMO_MODEL_ID, tools=TOOLS,
                messages=[{"role": "user", "content": "Hello! Who are you?"}])
        finally:
            await client.close()
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    assert choice.message.content


async def test_demo_accepts_agent_sized_contexts(demo_engine):
    """opencode's fixed prompt is ~17K tokens with the demo vocabulary: the default takes
    32K (the model need not answer well that deep; the protocol must work). A 20K-token
    prompt is accepted (the stream starts; the test then disconnects, which cancels the
    prefill), a 40K-token one is the 400 clients compact on."""
    assert demo_engine.max_context >= 32768
    filler = "ls -la src/ && pytest -q tests/ && git status\n"
    per_line = len(demo_engine.encode_prompt(
        [Segment("<role>HUMAN</role>", True), Segment(filler * 10, False)])) / 10
    async with running_server(demo_engine) as srv, aiohttp.ClientSession() as session:
        for tokens, status in ((20_000, 200), (40_000, 400)):
            body = {"model": DEMO_MODEL_ID, "stream": True, "max_tokens": 8, "messages": [
                {"role": "user", "content": filler * int(tokens / per_line)}]}
            async with session.post(srv.v1 + "/chat/completions", json=body) as response:
                assert response.status == status
                if status == 400:
                    error = (await response.json())["error"]
                    assert error["code"] == "context_length_exceeded"
                    assert "maximum context length is 32768 tokens" in error["message"]
    assert await asyncio.to_thread(demo_engine.wait_idle, 120)

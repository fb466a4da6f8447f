"""The requests of issue 24 against the embedded demo model through the official openai
SDK: the trained model (greedy by its generation config), the real engine and server.

* opencode's session-title request declares no tools: the answer holds no call markup
  (before the call guard the demo titled every session ``<tool_call>get_weather``);
* a question that tempts an undeclared tool ("How warm is it in London today?" with only
  ``get_weather`` and ``get_time``) answers with a declared tool or text, never markup;
* LangChain's ``with_structured_output(Model, method="function_calling")`` (emulated: the
  same request through the openai SDK, a named ``tool_choice`` and no ``max_tokens``)
  finishes with a call;
* a forced call cut by a small ``max_tokens`` is returned in ``tool_calls`` with
  ``finish_reason: "length"``, streamed or not.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import running_server
from test_demo_agent import TOOLS

from ling3_rknn.chat import markers
from ling3_rknn.demo import DEMO_MODEL_ID, load_demo_engine

# opencode's title agent (packages/opencode/src/session/prompt/title.txt, abridged): a
# system prompt, the user's first message, no tools, streamed.
TITLE_REQUEST = [
    {"role": "system", "content": "You are a title generator. You output ONLY a thread "
                                  "title. Nothing else.\n\nGenerate a brief title that "
                                  "would help the user find this conversation later."},
    {"role": "user", "content": "Generate a title for this conversation:\n"},
    {"role": "user", "content": "What is the weather in Lisbon?"},
]
# pydantic's schema for `class Weather(BaseModel): city: str; summary: str`, as LangChain's
# convert_to_openai_tool writes it.
WEATHER_MODEL = {"type": "function", "function": {
    "name": "Weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"},
        "summary": {"type": "string", "description": "one line"}},
        "required": ["city", "summary"]}}}
NAMED = {"type": "function", "function": {"name": "Weather"}}


@pytest.fixture(scope="module")
def demo_engine():
    engine = load_demo_engine()
    yield engine
    engine.close()


def no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in markers.CONTROL_MARKERS), text


async def streamed(client: openai.AsyncOpenAI, **kwargs) -> tuple[str, list, str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed answer."""
    content, calls, finish = "", [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [(c.function.name, c.function.arguments)
                      for c in choice.delta.tool_calls or ()]
            finish = choice.finish_reason or finish
    return content, calls, finish


async def test_opencodes_title_request_gets_no_markup(demo_engine):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        content, calls, finish = await streamed(client, model=DEMO_MODEL_ID,
                                                messages=TITLE_REQUEST)
        assert calls == [] and finish in ("stop", "length")
        no_markup(content)
        await client.close()


@pytest.mark.parametrize("question", ["How warm is it in London today?",
                                      "Will it rain in Berlin tomorrow?",
                                      "What's the forecast for Oslo this week?"])
async def test_a_question_tempting_an_undeclared_tool_gets_no_markup(demo_engine, question):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        reply = await client.chat.completions.create(
            model=DEMO_MODEL_ID, messages=[{"role": "user", "content": question}], tools=TOOLS)
        message = reply.choices[0].message
        no_markup(message.content)
        for call in message.tool_calls or ():
            assert call.function.name in {"get_weather", "get_time"}
            assert json.loads(call.function.arguments).keys() == {"city"}
        await client.close()


async def test_langchain_structured_output_without_max_tokens_finishes(demo_engine):
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        reply = await client.chat.completions.create(
            model=DEMO_MODEL_ID, tools=[WEATHER_MODEL], tool_choice=NAMED,
            messages=[{"role": "user", "content": "What is the weather in Lisbon?"}])
        choice = reply.choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "Weather"
        arguments = json.loads(call.function.arguments)
        if choice.finish_reason == "tool_calls":  # a whole object, as the parser wants
            assert arguments.keys() == {"city", "summary"}
        else:
            assert choice.finish_reason == "length"
        await client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_a_forced_call_cut_by_max_tokens_is_returned_as_a_call(demo_engine, stream):
    request = dict(model=DEMO_MODEL_ID, tools=[WEATHER_MODEL], tool_choice=NAMED,
                   max_tokens=40, reasoning_effort="none",
                   messages=[{"role": "user", "content": "What is the weather in Lisbon?"}])
    async with running_server(demo_engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        for max_tokens in (8, 12):  # inside the first value, inside the second key
            request["max_tokens"] = max_tokens
            if stream:
                content, calls, finish = await streamed(client, **request)
            else:
                choice = (await client.chat.completions.create(**request)).choices[0]
                content, finish = choice.message.content, choice.finish_reason
                calls = [(c.function.name, c.function.arguments)
                         for c in choice.message.tool_calls or ()]
            assert finish == "length" and not content, (content, calls)
            ((name, arguments),) = calls
            assert name == "Weather" and isinstance(json.loads(arguments), dict)
        await client.close()

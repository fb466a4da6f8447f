"""The official ``openai`` Python SDK against the running server over real HTTP:
stream and non-stream, tool calls, tool results, reasoning, errors.

The scripted engine emits the text a Ling model writes (``<think>`` bodies, ``<tool_call>``
blocks, split at awkward points); the real renderer and parser turn it into OpenAI shapes.
Raw bodies are also checked with the SDK's own pydantic models in strict validation.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from scripted_engine import ONE_CALL, ScriptedEngine
from server_harness import parse_sse, running_server

READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["path"],
        },
        "strict": False,
    },
}
USER = {"role": "user", "content": "Show me a.py"}
MODEL = "ling-3.0-tiny"

# What the model writes after the generation prompt "<role>ASSISTANT</role>\n<think>".
REASONED_ANSWER = ["I should", " greet.</th", "ink>Hel", "lo!"]
TWO_CALLS = [
    "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>",
    "\n<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>b.py</arg_value>\n</tool_call>",
]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


_clients: list[openai.AsyncOpenAI] = []


def client_for(base: str, **kwargs) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(
        base_url=base, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs
    )
    _clients.append(client)
    return client


@pytest.fixture(autouse=True)
async def close_clients():
    yield
    while _clients:
        await _clients.pop().close()


def extra(obj, name: str):
    """Fields outside OpenAI's own schema (``reasoning_content``) land in model_extra."""
    return (obj.model_extra or {}).get(name)


async def test_plain_answer_non_stream(engine):
    engine.push("</think>Hello", " world", cached_tokens=4)
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(model=MODEL, messages=[USER])
    assert completion.choices[0].message.content == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 2
    assert completion.usage.prompt_tokens_details.cached_tokens == 4


async def test_plain_answer_stream_with_usage(engine):
    engine.push("</think>Hello", " world")
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[USER], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


async def test_reasoning_is_split_out(engine):
    engine.push(*REASONED_ANSWER)
    engine.push(*REASONED_ANSWER)
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(model=MODEL, messages=[USER])
        stream = await client.chat.completions.create(model=MODEL, messages=[USER], stream=True)
        chunks = [chunk async for chunk in stream]
    message = completion.choices[0].message
    assert extra(message, "reasoning_content") == "I should greet."
    assert message.content == "Hello!"
    # one token per scripted piece: three were generated before the answer began
    assert completion.usage.completion_tokens_details.reasoning_tokens == 3
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == "I should greet."
    assert "".join(d.content or "" for d in deltas) == "Hello!"
    # reasoning strictly before content
    kinds = [
        "r" if extra(d, "reasoning_content") else "c"
        for d in deltas
        if d.content or extra(d, "reasoning_content")
    ]
    assert kinds == sorted(kinds, key=lambda k: k == "c")


async def test_thinking_off_puts_everything_in_content(engine):
    engine.push("Just ", "text.")
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(
            model=MODEL, messages=[USER], reasoning_effort="none"
        )
    assert completion.choices[0].message.content == "Just text."
    assert extra(completion.choices[0].message, "reasoning_content") is None
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0
    prompt = "".join(s.text for s in engine.requests[0].prompt)
    assert prompt.endswith("<think></think>")


async def test_tool_call_non_stream(engine):
    engine.push(*ONE_CALL)
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(
            model=MODEL, messages=[USER], tools=[READ_TOOL]
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert extra(choice.message, "reasoning_content") == "Need the file."
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_") and call.id[5:].isalnum() and len(call.id) > 12
    assert call.function.name == "read"
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"path": "a.py", "limit": 20}


async def test_tool_call_stream_with_sdk_helper(engine):
    engine.push(*ONE_CALL)
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        async with client.chat.completions.stream(
            model=MODEL, messages=[USER], tools=[READ_TOOL]
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_completion()
    kinds = {event.type for event in events}
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "read"
    assert json.loads(call.function.arguments) == {"path": "a.py", "limit": 20}


async def test_parallel_tool_calls_stream_one_chunk_per_call(engine):
    engine.push(*TWO_CALLS)
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[USER], tools=[READ_TOOL], stream=True
        )
        chunks = [chunk async for chunk in stream]
    call_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(call_chunks) == 2
    calls = [c.choices[0].delta.tool_calls[0] for c in call_chunks]
    assert [c.index for c in calls] == [0, 1]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert calls[0].id != calls[1].id
    assert [json.loads(c.function.arguments)["path"] for c in calls] == ["a.py", "b.py"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_parallel_tool_calls_false_keeps_only_the_first(engine):
    engine.push(*TWO_CALLS)
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(
            model=MODEL, messages=[USER], tools=[READ_TOOL], parallel_tool_calls=False
        )
    assert len(completion.choices[0].message.tool_calls) == 1


async def test_undeclared_tool_is_released_as_content(engine):
    text = "<tool_call>delete\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>"
    engine.push("</think>", text[:9], text[9:])
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(
            model=MODEL, messages=[USER], tools=[READ_TOOL]
        )
    message = completion.choices[0].message
    assert not message.tool_calls
    assert completion.choices[0].finish_reason == "stop"
    assert message.content == text


async def test_tool_choice_none_leaves_call_text_as_content(engine):
    engine.push("</think>", *TWO_CALLS[:1])
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        completion = await client.chat.completions.create(
            model=MODEL, messages=[USER], tools=[READ_TOOL], tool_choice="none"
        )
    assert not completion.choices[0].message.tool_calls
    assert completion.choices[0].message.content == TWO_CALLS[0]
    prompt = "".join(s.text for s in engine.requests[0].prompt)
    assert '"name": "read"' in prompt  # tools stay in the prompt (prefix cache stable)


async def test_tool_results_round_trip(engine):
    """The second turn of an agent loop: the call the server returned plus its result
    are sent back and rendered into the Ling prompt."""
    engine.push(*ONE_CALL)
    engine.push("</think>It prints 1.")
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        first = await client.chat.completions.create(
            model=MODEL, messages=[USER], tools=[READ_TOOL]
        )
        message = first.choices[0].message
        history = [
            USER,
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": extra(message, "reasoning_content"),
                "tool_calls": [call.model_dump() for call in message.tool_calls],
            },
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "print(1)"},
        ]
        second = await client.chat.completions.create(
            model=MODEL, messages=history, tools=[READ_TOOL]
        )
    assert second.choices[0].message.content == "It prints 1."
    prompt = "".join(s.text for s in engine.requests[1].prompt)
    generated = "".join(ONE_CALL)
    # The replayed turn renders to exactly the text the model generated (prefix cache).
    assert "<role>ASSISTANT</role>\n<think>" + generated + "<|role_end|>" in prompt
    assert (
        "<role>OBSERVATION</role>\n<tool_response>\nprint(1)\n</tool_response><|role_end|>"
        in prompt
    )


async def test_developer_role_and_text_parts(engine):
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            store=False,
            max_completion_tokens=50,
        )
    prompt = "".join(s.text for s in engine.requests[0].prompt)
    assert "Be brief." in prompt
    assert engine.requests[0].max_tokens == 50


async def test_sdk_error_mapping(engine):
    small = ScriptedEngine(max_context=8)
    async with running_server(small) as srv:
        client = client_for(srv.v1)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * 400}]
            )
        assert info.value.code == "context_length_exceeded"
        assert "maximum context length is 8 tokens" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=[USER], n=2)
        assert info.value.param == "n"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-5", messages=[USER])
        small.push("x", fail="busy")
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model=MODEL, messages=[USER])
        assert info.value.status_code == 503
    from ling3_rknn.server import AppConfig

    async with running_server(engine, AppConfig(api_key="k")) as srv:
        with pytest.raises(openai.AuthenticationError):
            await client_for(srv.v1, api_key="wrong").chat.completions.create(
                model=MODEL, messages=[USER]
            )
        ok = await client_for(srv.v1, api_key="k").chat.completions.create(
            model=MODEL, messages=[USER]
        )
        assert ok.choices[0].message.content == "Hello world!"
        models = await client_for(srv.v1, api_key="k").models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_error_event_mid_stream_raises_in_the_sdk(engine):
    engine.push("a", "b", "c", "d", fail="failure_mid")
    async with running_server(engine) as srv:
        client = client_for(srv.v1)
        stream = await client.chat.completions.create(model=MODEL, messages=[USER], stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


@pytest.mark.parametrize("script", [REASONED_ANSWER, ONE_CALL, TWO_CALLS])
async def test_raw_bodies_validate_strictly_and_stream_matches_whole(engine, script):
    """Strict pydantic validation of raw JSON with the SDK's own types, and the streamed
    deltas concatenate to the non-stream message."""
    engine.push(*script)
    engine.push(*script)
    payload = {"model": MODEL, "messages": [USER], "tools": [READ_TOOL]}
    async with running_server(engine) as srv, aiohttp.ClientSession() as s:
        async with s.post(srv.v1 + "/chat/completions", json=payload) as r:
            whole = await r.json()
        stream_payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(srv.v1 + "/chat/completions", json=stream_payload) as r:
            events, _ = parse_sse(await r.text())
    ChatCompletion.model_validate(whole, strict=True)
    chunks = [ChatCompletionChunk.model_validate(e, strict=True) for e in events[:-1]]
    message = whole["choices"][0]["message"]
    reasoning = "".join(
        extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == (message.get("reasoning_content") or "")
    assert content == (message["content"] or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", [])
    ]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole["choices"][0]["finish_reason"]]
    assert events[-2]["usage"] == whole["usage"]  # the usage chunk, reasoning tokens included

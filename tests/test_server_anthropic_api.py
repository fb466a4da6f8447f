"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` with the official ``anthropic``
SDK over real HTTP (create, stream, the tool loop, thinking round trip, errors), raw events
checked with the SDK's own types, and the reader on what Claude Code really sends
(captured from Claude Code 2.1.332). Also the routes both families share: ``/v1/models``,
auth, the unknown-route 404.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from scripted_engine import ONE_CALL, ScriptedEngine, prompt_text
from server_harness import running_server

from ling3_rknn.server import AppConfig, reasoning_seal
from ling3_rknn.server.anthropic_api.reader import read_messages_request
from ling3_rknn.server.errors import ApiError

MODEL = "ling-3.0-tiny"
READ_TOOL = {"name": "read", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["path"]}}
THINK = {"type": "enabled", "budget_tokens": 1024}
USER = {"role": "user", "content": "Show me a.py"}
CLAUDE_REQUEST = (Path(__file__).parent / "fixtures" / "clients"
                  / "claude-code-2.1.332-first-request.json")


@pytest.fixture
async def client_and_engine():
    engine = ScriptedEngine()
    async with running_server(engine) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.base, api_key="none", max_retries=0)
        try:
            yield client, engine, srv
        finally:
            await client.close()


def prompt_of(engine: ScriptedEngine, i: int) -> str:
    return prompt_text(engine.requests[i])


async def test_tool_loop_with_thinking_round_trip(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push(*ONE_CALL)
    engine.push("</think>It prints ", "1.", cached_tokens=40)
    first = await client.messages.create(model=MODEL, max_tokens=200, messages=[USER],
                                         tools=[READ_TOOL], thinking=THINK)
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking == "Need the file."
    assert call.type == "tool_use" and call.name == "read"
    assert call.input == {"path": "a.py", "limit": 20}
    assert first.stop_reason == "tool_use"
    messages = [USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                         for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "print(1)"}]}]
    second = await client.messages.create(model=MODEL, max_tokens=200, messages=messages,
                                          tools=[READ_TOOL], thinking=THINK)
    assert second.content[0].text == "It prints 1."
    assert second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens == 40
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert total == len(prompt_of(engine, 1)) // 4  # the scripted engine's token count
    generated = "".join(ONE_CALL)
    assert "<role>ASSISTANT</role>\n<think>" + generated + "<|role_end|>" in prompt_of(engine, 1)


async def test_omitted_thinking_comes_back_through_its_signature(client_and_engine):
    """Claude Code asks for ``display: "omitted"``: no thinking text reaches it, yet the
    block it sends back re-renders the reasoning the model wrote."""
    client, engine, _ = client_and_engine
    engine.push(*ONE_CALL)
    engine.push("</think>ok")
    thinking = {"type": "adaptive", "display": "omitted"}
    async with client.messages.stream(model=MODEL, max_tokens=200, messages=[USER],
                                      tools=[READ_TOOL], thinking=thinking) as stream:
        kinds = [event.type async for event in stream]
        first = await stream.get_final_message()
    assert "thinking" not in kinds  # no thinking deltas
    block, call = first.content
    assert block.thinking == "" and reasoning_seal.unseal(block.signature) == "Need the file."
    await client.messages.create(model=MODEL, max_tokens=50, thinking=thinking, tools=[READ_TOOL],
                                 messages=[USER, {"role": "assistant", "content": [
                                     b.model_dump(exclude_none=True) for b in first.content]},
                                     {"role": "user", "content": [{
                                         "type": "tool_result", "tool_use_id": call.id,
                                         "content": [{"type": "text", "text": "print(1)"}]}]}])
    assert "<think>" + "".join(ONE_CALL) + "<|role_end|>" in prompt_of(engine, 1)


async def test_stream_events_validate_and_match_whole(client_and_engine):
    _, engine, srv = client_and_engine
    engine.push(*ONE_CALL)
    engine.push(*ONE_CALL)
    body = {"model": MODEL, "max_tokens": 100, "messages": [USER], "tools": [READ_TOOL],
            "thinking": THINK}
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.v1 + "/messages", json=body) as r:
            whole = await r.json()
        async with session.post(srv.v1 + "/messages", json={**body, "stream": True}) as r:
            raw = await r.text()
    Message.model_validate(whole)
    adapter = TypeAdapter(RawMessageStreamEvent)
    names = []
    blocks: dict[int, dict] = {}
    for chunk in raw.strip().split("\n\n"):
        name, data = chunk.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == "event: " + payload["type"]
        names.append(payload["type"])
        if payload["type"] == "ping":
            continue
        adapter.validate_python(payload)
        if payload["type"] == "content_block_start":
            blocks[payload["index"]] = dict(payload["content_block"])
        elif payload["type"] == "content_block_delta":
            delta, block = payload["delta"], blocks[payload["index"]]
            key = {"thinking_delta": "thinking", "signature_delta": "signature",
                   "text_delta": "text", "input_json_delta": "partial_json"}[delta["type"]]
            block[key] = block.get(key, "") + delta[key]
        elif payload["type"] == "message_delta":
            assert payload["delta"]["stop_reason"] == whole["stop_reason"]
            assert payload["usage"] == whole["usage"]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    start = json.loads(raw.split("\n\n")[0].split("\n")[1].removeprefix("data: "))
    usage = whole["usage"]  # the admitted prompt, whole, until the final split
    assert start["message"]["usage"]["input_tokens"] == (usage["input_tokens"]
                                                         + usage["cache_read_input_tokens"])
    tool = blocks[1]
    tool["input"] = json.loads(tool.pop("partial_json"))
    assert [blocks[i] for i in sorted(blocks)] == [
        {k: v for k, v in b.items() if k != "id"} | ({"id": tool["id"]} if "id" in b else {})
        for b in whole["content"]]


async def test_tool_result_images_become_a_note(client_and_engine):
    client, engine, _ = client_and_engine
    await client.messages.create(model=MODEL, max_tokens=5, tools=[READ_TOOL], messages=[
        USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": {
                                          "type": "base64", "media_type": "image/png",
                                          "data": "AAAA"}}]},
                                     {"type": "text", "text": "What is in it?"}]}])
    prompt = prompt_of(engine, 0)
    assert "<tool_response>\n[image omitted: this model reads text only]\n" in prompt
    # the result answers the call first, the user's text follows it
    assert prompt.index("[image omitted") < prompt.index("What is in it?")


async def test_stop_sequence_max_tokens_and_no_thinking(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push("The answer", stop="###")
    done = await client.messages.create(model=MODEL, max_tokens=20, messages=[USER],
                                        stop_sequences=["###"], system="Be brief.")
    assert (done.stop_reason, done.stop_sequence) == ("stop_sequence", "###")
    assert engine.requests[0].stop[0] == "###"
    assert prompt_of(engine, 0).endswith("<think></think>")  # no `thinking`: off
    assert "Be brief." in prompt_of(engine, 0)
    engine.push("a", "b", finish_reason="length")
    done = await client.messages.create(model=MODEL, max_tokens=2, messages=[USER])
    assert done.stop_reason == "max_tokens"


async def test_count_tokens(client_and_engine):
    client, engine, _ = client_and_engine
    counted = await client.messages.count_tokens(model=MODEL, messages=[USER],
                                                 tools=[READ_TOOL], system="Be brief.")
    engine.push("</think>hi")
    done = await client.messages.create(model=MODEL, max_tokens=5, messages=[USER],
                                        tools=[READ_TOOL], system="Be brief.")
    assert counted.input_tokens == done.usage.input_tokens + done.usage.cache_read_input_tokens


@pytest.mark.parametrize(("body", "where"), [
    ({"messages": [USER]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": [USER], "tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({"max_tokens": 5, "messages": [USER], "tool_choice": {"type": "tool", "name": "read"}},
     "tool_choice.name"),
    ({"max_tokens": 5, "messages": [USER, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
     "messages[1].content[0].tool_use_id"),
    ({"max_tokens": 5, "messages": [USER], "temprature": 1}, "temprature"),
    ({"max_tokens": 5, "messages": [USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "edited", "signature": reasoning_seal.seal("x")}]}]},
     "messages[1].content[0].signature"),
])
async def test_bad_input_is_a_400_naming_the_field(client_and_engine, body, where):
    client, _, _ = client_and_engine
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.post("/v1/messages", body={"model": MODEL, **body}, cast_to=Message)
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(where)


async def test_errors_in_the_anthropic_shape(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push("x", fail="context")
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model=MODEL, max_tokens=5, messages=[USER])
    # Claude Code compacts on this wording.
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 4096 maximum",
                        info.value.body["error"]["message"])
    engine.push("x", fail="busy")
    with pytest.raises(anthropic.APIStatusError) as busy:
        await client.messages.create(model=MODEL, max_tokens=5, messages=[USER], stream=True)
    assert busy.value.status_code == 529
    assert busy.value.body["error"]["type"] == "overloaded_error"
    assert busy.value.response.headers["retry-after"] == "1"
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="claude-opus-4", max_tokens=5, messages=[USER])
    assert missing.value.body["type"] == "error"
    engine.push("</think>a", "b", "c", "d", fail="failure_mid")
    with pytest.raises(anthropic.APIStatusError):
        async with client.messages.stream(model=MODEL, max_tokens=5, messages=[USER]) as s:
            async for _ in s:
                pass


async def test_auth_models_and_unknown_routes():
    engine = ScriptedEngine()
    async with running_server(engine, AppConfig(api_key="k")) as srv:
        wrong = anthropic.AsyncAnthropic(base_url=srv.base, api_key="bad", max_retries=0)
        right = anthropic.AsyncAnthropic(base_url=srv.base, api_key="k", max_retries=0)
        oai = openai.AsyncOpenAI(base_url=srv.v1, api_key="k", max_retries=0)
        try:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await wrong.messages.create(model=MODEL, max_tokens=5, messages=[USER])
            assert info.value.body["error"]["type"] == "authentication_error"
            done = await right.messages.create(model=MODEL, max_tokens=5, messages=[USER],
                                               thinking=THINK)
            assert done.content[0].text == "Hello world!"
            assert [m.id for m in (await right.models.list()).data] == [MODEL]
            assert [m.id for m in (await oai.models.list()).data] == [MODEL]
            assert (await right.models.retrieve(MODEL)).display_name == MODEL
        finally:
            for c in (wrong, right, oai):
                await c.close()
        async with (aiohttp.ClientSession() as session,
                    session.post(srv.v1 + "/complete", headers={"x-api-key": "k"}) as r):
            assert r.status == 404
            error = (await r.json())["error"]
        assert error["code"] == "unknown_route"
        assert "POST /v1/complete" in error["message"]
        for served in ("POST /v1/responses", "POST /v1/messages", "POST /v1/chat/completions"):
            assert served in error["message"]


def test_claude_code_first_request_reads_as_it_means_it():
    """The body Claude Code 2.1.332 sent (captured against this server): system blocks
    with cache_control, a mid-conversation system turn, adaptive thinking with the text
    omitted, context_management and output_config hints, a deferred tool."""
    body = json.loads(CLAUDE_REQUEST.read_text())["body"]
    request, notes = read_messages_request(body)
    assert request.enable_thinking and not notes.show_thinking
    assert [m["role"] for m in request.messages][:3] == ["system", "user", "system"]
    assert "Read" in [t["function"]["name"] for t in request.tools]
    assert request.stream and request.max_tokens == 32000


def test_reader_never_raises_anything_but_api_errors():
    for body in ({"model": MODEL}, {"model": MODEL, "max_tokens": 1, "messages": 3},
                 {"model": MODEL, "max_tokens": 1, "messages": [3]},
                 {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": 3}]},
                 {"model": MODEL, "max_tokens": 1, "messages": [USER], "tools": [3]},
                 {"model": MODEL, "max_tokens": 1, "messages": [USER], "tool_choice": 3},
                 {"model": MODEL, "max_tokens": 1, "messages": [USER], "thinking": {}}):
        with pytest.raises(ApiError) as info:
            read_messages_request(body)
        assert info.value.status == 400

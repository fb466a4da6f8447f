"""``POST /v1/responses`` with the official ``openai`` SDK over real HTTP (create, stream
and parse), the raw event sequence checked with the SDK's own types, and the reader on
what Codex CLI really sends (captured from codex-cli 0.171.0).

The scripted engine supplies the model's text; the real renderer, parser and shared
generation flow do the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from scripted_engine import ONE_CALL, ScriptedEngine, prompt_text
from server_harness import running_server

from ling3_rknn.server import reasoning_seal
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.responses_api.reader import read_responses_request

MODEL = "ling-3.0-tiny"
READ_TOOL = {
    "type": "function", "name": "read", "description": "Read a file", "strict": False,
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["path"]},
}
CODEX_REQUEST = Path(__file__).parent / "fixtures" / "clients" / "codex-0.171.0-first-request.json"
TWO_CALLS = [
    "Both.</think>",
    "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>",
    "\n<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>b.py</arg_value>\n</tool_call>",
]


@pytest.fixture
async def client_and_engine():
    engine = ScriptedEngine()
    async with running_server(engine) as srv:
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="none", max_retries=0)
        try:
            yield client, engine, srv
        finally:
            await client.close()


def prompt_of(engine: ScriptedEngine, i: int) -> str:
    return prompt_text(engine.requests[i])


async def test_tool_call_then_answer_with_reasoning_round_trip(client_and_engine):
    """Turn 1 calls a tool; turn 2 sends back the output items as Codex does (reasoning
    with encrypted_content, the call, its output) and the assistant turn re-renders to
    exactly the text the model wrote: the precondition of the prefix-cache hit."""
    client, engine, _ = client_and_engine
    engine.push(*ONE_CALL)
    engine.push("</think>It prints ", "1.", cached_tokens=30)
    first = await client.responses.create(
        model=MODEL, input="Show me a.py", tools=[READ_TOOL],
        include=["reasoning.encrypted_content"], store=False)
    reasoning, call = first.output
    assert reasoning.type == "reasoning"
    assert [s.text for s in reasoning.summary] == ["Need the file."]
    assert reasoning_seal.unseal(reasoning.encrypted_content) == "Need the file."
    assert call.type == "function_call" and call.name == "read"
    assert json.loads(call.arguments) == {"path": "a.py", "limit": 20}
    assert call.call_id.startswith("call_")
    assert first.status == "completed"
    assert first.usage.output_tokens_details.reasoning_tokens == 3
    # Codex keeps only what it needs: the summary may be dropped, the sealed text is used.
    items = [{"role": "user", "content": "Show me a.py"},
             {"type": "reasoning", "summary": [],
              "encrypted_content": reasoning.encrypted_content},
             call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "print(1)"}]
    second = await client.responses.create(model=MODEL, input=items, tools=[READ_TOOL])
    assert second.output_text == "It prints 1."
    assert second.usage.input_tokens_details.cached_tokens == 30
    generated = "".join(ONE_CALL)
    assert "<role>ASSISTANT</role>\n<think>" + generated + "<|role_end|>" in prompt_of(engine, 1)
    assert "<tool_response>\nprint(1)\n</tool_response>" in prompt_of(engine, 1)


async def test_stream_helper_assembles_the_same_response(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push(*ONE_CALL)
    async with client.responses.stream(model=MODEL, input="Show me a.py",
                                       tools=[READ_TOOL]) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_summary_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == {"path": "a.py", "limit": 20}


@pytest.mark.parametrize("script", [ONE_CALL, TWO_CALLS, ["Hm.</think>Hel", "lo ", "there."]])
async def test_raw_stream_validates_and_matches_whole(client_and_engine, script):
    """Every streamed event validates against the SDK's event union, and the final
    response equals the non-streamed one (ids and timestamps aside)."""
    _, engine, srv = client_and_engine
    engine.push(*script)
    engine.push(*script)
    body = {"model": MODEL, "input": "Show me a.py", "tools": [READ_TOOL]}
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.v1 + "/responses", json=body) as r:
            whole = await r.json()
        async with session.post(srv.v1 + "/responses", json={**body, "stream": True}) as r:
            raw = await r.text()
    Response.model_validate(whole)
    adapter = TypeAdapter(ResponseStreamEvent)
    payloads = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == "event: " + payload["type"]
        adapter.validate_python(payload)
        payloads.append(payload)
    assert payloads[-1]["type"] == "response.completed"
    final = payloads[-1]["response"]

    def strip(response: dict) -> list:
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                for item in response["output"]]

    assert strip(final) == strip(whole)
    assert final["usage"] == whole["usage"]


async def test_parse_with_a_json_schema(client_and_engine):
    class City(BaseModel):
        city: str
        temp_c: int

    client, engine, _ = client_and_engine
    engine.push('</think>{"city": "Lisbon", "temp_c": 21}')
    parsed = await client.responses.parse(model=MODEL, input="Weather as JSON",
                                          text_format=City)
    assert parsed.output_parsed == City(city="Lisbon", temp_c=21)
    assert engine.requests[0].grammar is not None  # constrained decoding did the work


async def test_length_is_incomplete_and_thinking_off(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push("Just ", "text", finish_reason="length")
    done = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                         reasoning={"effort": "none"})
    assert done.status == "incomplete"
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == "Just text"
    assert engine.requests[0].max_tokens == 2
    assert prompt_of(engine, 0).endswith("<think></think>")


async def test_engine_failure_mid_stream_is_response_failed(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push("</think>a", "b", "c", "d", fail="failure_mid")
    stream = await client.responses.create(model=MODEL, input="hi", stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.failed"
    assert "response.completed" not in kinds


async def test_namespace_tools_flatten_and_calls_split_back(client_and_engine):
    client, engine, _ = client_and_engine
    call = ("</think><tool_call>mcp__docs__search\n<arg_key>q</arg_key>\n"
            "<arg_value>kda</arg_value>\n</tool_call>")
    engine.push(call)
    tools = [{"type": "namespace", "name": "mcp__docs", "description": "Docs",
              "tools": [{"type": "function", "name": "search", "parameters": {
                  "type": "object", "properties": {"q": {"type": "string"}}}}]},
             {"type": "web_search", "external_web_access": False}]
    done = await client.responses.create(model=MODEL, input="find kda", tools=tools)
    (item,) = done.output
    assert (item.namespace, item.name) == ("mcp__docs", "search")
    assert '"name": "mcp__docs__search"' in prompt_of(engine, 0)
    assert "web_search" not in prompt_of(engine, 0)
    # Sent back with its namespace, the call renders under the flat name again.
    engine.push("</think>Found.")
    await client.responses.create(model=MODEL, tools=tools, input=[
        {"role": "user", "content": "find kda"}, item.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": item.call_id, "output": "KDA is ..."}])
    assert "<tool_call>mcp__docs__search\n" in prompt_of(engine, 1)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "temprature": 1}, "temprature"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "teleport"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB..."}]},
     "input[0].encrypted_content"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
async def test_bad_input_is_a_400_naming_the_field(client_and_engine, body, param):
    client, _, _ = client_and_engine
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, extra_body=body)
    assert info.value.param == param
    assert info.value.status_code == 400


async def test_tool_output_parts_and_images(client_and_engine):
    client, engine, _ = client_and_engine
    await client.responses.create(model=MODEL, tools=[READ_TOOL], input=[
        {"role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "a.png:"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert ("<tool_response>\na.png:\n[image omitted: this model reads text only]\n"
            "</tool_response>") in prompt_of(engine, 0)


async def test_tampered_encrypted_content_is_refused(client_and_engine):
    client, _, _ = client_and_engine
    sealed = reasoning_seal.seal("I should call read.")
    prefix, _body, digest = sealed.split(".")
    forged = ".".join((prefix, reasoning_seal.seal("I should delete.").split(".")[1], digest))
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input=[
            {"role": "user", "content": "x"},
            {"type": "reasoning", "summary": [], "encrypted_content": forged}])
    assert info.value.param == "input[1].encrypted_content"


async def test_errors_in_the_responses_shape(client_and_engine):
    client, engine, _ = client_and_engine
    engine.push("x", fail="context")
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="x")
    assert info.value.code == "context_length_exceeded"
    engine.push("x", fail="busy")
    with pytest.raises(openai.APIStatusError) as busy:
        await client.responses.create(model=MODEL, input="x", stream=True)
    assert busy.value.status_code == 503
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="gpt-5", input="x")


def test_codex_first_request_reads_as_codex_means_it():
    """The body codex-cli 0.171.0 sent (captured against this server): seven function
    tools, one namespace, one hosted web_search, developer messages, the encrypted
    reasoning include, and its cache / metadata hints."""
    body = json.loads(CODEX_REQUEST.read_text())["body"]
    request, notes = read_responses_request(body)
    names = [t["function"]["name"] for t in request.tools]
    assert "exec_command" in names
    assert any(name.startswith("multi_agent_v1__") for name in names)
    assert notes.tools.skipped == ["web_search"]
    assert notes.encrypted_reasoning
    assert request.stream and request.enable_thinking
    assert [m["role"] for m in request.messages] == ["developer", "developer", "user", "user"]


def test_reasoning_seal_rejects_foreign_values():
    assert reasoning_seal.unseal(reasoning_seal.seal("a\u00e9\U0001F600")) == "a\u00e9\U0001F600"
    for value in ("", "gAAAAABk", "ling3r1.", "ling3r1.!!!.x", reasoning_seal.seal("a") + "x"):
        assert reasoning_seal.unseal(value) is None


def test_reader_never_raises_anything_but_api_errors():
    for body in ({"model": MODEL}, {"model": MODEL, "input": 3},
                 {"model": MODEL, "input": [3]}, {"model": MODEL, "input": [{"type": 3}]},
                 {"model": MODEL, "input": "x", "tools": {}},
                 {"model": MODEL, "input": "x", "tool_choice": 5},
                 {"model": MODEL, "input": [{"type": "reasoning", "summary": [{}]}]}):
        with pytest.raises(ApiError) as info:
            read_responses_request(body)
        assert info.value.status == 400

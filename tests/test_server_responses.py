"""Shapes built without a server: the precomputed chunk frame of the hot streaming path
gives byte-identical events to encoding the whole chunk."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ling3_rknn.chat import ToolCall, ToolCallParsed, Usage, new_tool_call_id
from ling3_rknn.server.responses import ChunkFactory, MessageBuilder
from ling3_rknn.server.sse import encode_event

MODELS = st.text(min_size=1, max_size=20)


@settings(deadline=None)  # hypothesis' 200 ms default fails on a loaded CPU
@given(text=st.text(), model=MODELS, include_usage=st.booleans())
def test_fast_text_events_equal_full_encoding(text, model, include_usage):
    chunks = ChunkFactory("chatcmpl-x", model, include_usage)
    assert chunks.content_event(text) == encode_event(chunks.content(text))
    assert chunks.reasoning_event(text) == encode_event(chunks.reasoning(text))
    decoded = json.loads(chunks.content_event(text)[len(b"data: ") : -2])
    assert decoded["choices"][0]["delta"] == {"content": text}
    assert decoded["model"] == model
    assert ("usage" in decoded) is include_usage


def test_tool_call_ids_are_call_plus_alphanumerics_and_unique():
    ids = {new_tool_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("call_") and i[5:].isalnum() and len(i) == 29 for i in ids)


def test_message_content_is_null_only_with_tool_calls():
    usage = Usage(10, 2, 4)
    empty = MessageBuilder().body("id", "m", 1, "stop", usage)
    assert empty["choices"][0]["message"] == {"role": "assistant", "content": ""}
    builder = MessageBuilder(tool_calls=[ToolCallParsed(0, ToolCall("read", {}, id="call_a"))])
    body = builder.body("id", "m", 1, "tool_calls", usage)
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    ]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }

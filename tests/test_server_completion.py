"""The completion pipeline (render -> engine -> parser -> events) without HTTP: however the
engine splits its text, the events add up to the chat module's whole-text parse."""

from __future__ import annotations

import asyncio
import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_engine import ScriptedEngine
from tool_fixtures import READ_TOOLS

from ling3_rknn import chat
from ling3_rknn.chat import ContentDelta, Finished, ReasoningDelta, ToolCallParsed
from ling3_rknn.server.completion import Completion
from ling3_rknn.server.validate import parse_chat_request

TOOLS = READ_TOOLS
OUTPUTS = [
    "I should greet.</think>Hello!",
    "Need the file.</think><tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>"
    "<arg_key>limit</arg_key>\n<arg_value>20</arg_value>\n</tool_call>",
    "Two.<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a</arg_value>\n</tool_call>\n"
    "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>b</arg_value>\n</tool_call>",
    "</think>Text <tool_call>nope\n</tool_call> and <arg_key> literal",
    "thinking never closed <think",
]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


async def collect(text: str, cuts: list[int], thinking: bool, tool_choice: str):
    engine = ScriptedEngine()
    engine.push(*split(text, cuts))
    request = parse_chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "chat_template_kwargs": {"enable_thinking": thinking},
        }
    )
    completion = Completion(engine, request)
    events = [event async for event in completion.events()]
    await completion.close()
    return events


@settings(max_examples=60, deadline=None)
@given(
    index=st.integers(0, len(OUTPUTS) - 1),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    thinking=st.booleans(),
    tool_choice=st.sampled_from(["auto", "none"]),
)
def test_events_add_up_to_the_whole_text_parse(index, cuts, thinking, tool_choice):
    text = OUTPUTS[index]
    events = asyncio.run(collect(text, cuts, thinking, tool_choice))
    expected = chat.parse_assistant(
        text, TOOLS if tool_choice == "auto" else None, thinking=thinking
    )
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == expected.reasoning
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == expected.content
    calls = [e for e in events if isinstance(e, ToolCallParsed)]
    assert [(c.call.name, json.loads(c.call.arguments_json())) for c in calls] == [
        (c.name, c.arguments) for c in expected.tool_calls
    ]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(c.call.id.startswith("call_") for c in calls)
    assert all(e.text for e in events if isinstance(e, ReasoningDelta | ContentDelta))
    done = events[-1]
    assert isinstance(done, Finished)
    assert done.finish_reason == ("tool_calls" if calls else "stop")
    assert sum(isinstance(e, Finished) for e in events) == 1

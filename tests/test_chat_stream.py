"""StreamingParser: split-invariance against parse_assistant, early emission, one event per call."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chat_parse import CASES, TOOLS, rc

from ling3_rknn.chat import (
    ContentDelta,
    ReasoningDelta,
    StreamingParser,
    ToolCall,
    ToolCallParsed,
    parse_assistant,
)


def _stream(text: str, cuts: list[int], tools, **kwargs):
    parser = StreamingParser(tools, **kwargs)
    events = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        events += parser.feed(text[a:b])
    events += parser.finish()
    return parser.result(), events


def _check(text: str, cuts: list[int], tools, **kwargs) -> None:
    whole = parse_assistant(text, tools, **kwargs)
    got, events = _stream(text, cuts, tools, **kwargs)
    assert got == whole
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == whole.reasoning
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == whole.content
    calls = [e for e in events if isinstance(e, ToolCallParsed)]
    assert [c.call for c in calls] == whole.tool_calls
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(e.text for e in events if not isinstance(e, ToolCallParsed))


def _case_kwargs(case):
    kwargs = dict(case[2])
    return kwargs.pop("tools", TOOLS), kwargs


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(CASES), st.data())
def test_any_split_of_table_texts_gives_the_whole_text_result(case, data):
    text = case[1]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    tools, kwargs = _case_kwargs(case)
    _check(text, cuts, tools, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_char_by_char_equals_whole(case):
    tools, kwargs = _case_kwargs(case)
    _check(case[1], list(range(len(case[1]))), tools, **kwargs)


PIECES = [
    "<tool_call>",
    "</tool_call>",
    "read",
    "now",
    "bash",
    "\n",
    " ",
    "<arg_key>",
    "</arg_key>",
    "path",
    "limit",
    "<arg_value>",
    "</arg_value>",
    "a.py",
    "20",
    "</think>",
    "<think>",
    "<|role_end|>",
    "x",
    "<",
    "<tool_",
    "</arg",
    "<|role",
    "é",
    "\n\n",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=30).map("".join),
    st.data(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_any_split_of_marker_soup_gives_the_whole_text_result(text, data, thinking, parallel,
                                                              calls_only_first):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    _check(text, cuts, TOOLS, thinking=thinking, parallel_tool_calls=parallel,
           calls_only_first=calls_only_first)


def test_calls_only_first_is_split_invariant_at_a_held_back_marker():
    text = "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>"
    for cut in range(len(text)):
        _check(text, [cut], TOOLS, thinking=False, calls_only_first=True)


def test_reasoning_and_content_stream_early():
    p = StreamingParser(TOOLS)
    assert p.feed("Let me") == [ReasoningDelta("Let me")]
    assert p.feed(" think</th") == [ReasoningDelta(" think")]
    assert p.feed("ink>Sure") == [ContentDelta("Sure")]
    assert p.feed(", here <tool") == [ContentDelta(", here ")]  # "<tool" held back
    assert p.feed("s> are") == [ContentDelta("<tools> are")]
    p.finish()
    assert p.result().content == "Sure, here <tools> are"


def test_call_is_emitted_once_when_complete():
    p = StreamingParser(TOOLS)
    text = "r</think>" + rc("a.py") + "\n" + rc("b.py")
    first_end = text.index("</tool_call>") + len("</tool_call>")
    events = p.feed(text[:first_end])
    assert events[-1] == ToolCallParsed(0, ToolCall("read", {"path": "a.py"}))
    assert p.feed(text[first_end:]) == [ToolCallParsed(1, ToolCall("read", {"path": "b.py"}))]
    assert p.finish() == []


def test_undeclared_call_is_released_early():
    p = StreamingParser(TOOLS, thinking=False)
    assert p.feed("<tool_call>rmdir") == [ContentDelta("<tool_call>rmdir")]


def test_newline_before_possible_call_is_held_then_released():
    p = StreamingParser(TOOLS, thinking=False)
    assert p.feed("Hi\n") == [ContentDelta("Hi")]
    assert p.feed("there") == [ContentDelta("\nthere")]


def test_without_tools_nothing_is_held_but_role_end():
    p = StreamingParser(None, thinking=False)
    assert p.feed("a\n<tool_call>") == [ContentDelta("a\n<tool_call>")]
    assert p.feed("<|role_end|>") == []
    assert p.finish() == []
    assert p.result().content == "a\n<tool_call>"


def test_api_misuse_is_an_error():
    p = StreamingParser()
    with pytest.raises(RuntimeError):
        p.result()
    p.finish()
    assert p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed("x")

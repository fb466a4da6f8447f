"""A call the end of a grammar-constrained turn cut short is a call, never content
(``StreamingParser(cut_calls=True)``, ``call_block.cut_call``; docs/serving.md 9.1)."""

from __future__ import annotations

import pytest
from constrained_tools import TOOLS

from ling3_rknn.chat import ContentDelta, StreamingParser, ToolCallParsed
from ling3_rknn.chat.call_block import cut_call
from ling3_rknn.chat.tool_schema import tool_table

TABLE = tool_table(TOOLS)


@pytest.mark.parametrize(("text", "name", "arguments"), [
    ("get_weather\n<arg_key>city</arg_key>\n<arg_value>Lis", "get_weather", {"city": "Lis"}),
    ("get_weather\n<arg_key>city</arg_key>\n<arg_value>Lisbon</arg_value><arg_key>da",
     "get_weather", {"city": "Lisbon"}),
    ("get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value><arg_key>days"
     "</arg_key>\n<arg_value>3", "get_weather", {"city": "Oslo", "days": 3}),
    ("search\n<arg_key>filters</arg_key>\n<arg_value>{\"lang\": ", "search",
     {"filters": '{"lang": '}),  # a JSON value cut mid-way stays the text generated
    ("get_wea", "get_weather", {}),  # the only declared name this prefix begins
    ("ping", "ping", {}),
])
def test_a_cut_block_is_the_call_it_was_writing(text, name, arguments):
    call = cut_call(text, TABLE)
    assert call is not None and call.name == name and call.arguments == arguments


@pytest.mark.parametrize("text", ["", "\n", "nope\n<arg_key>x</arg_key>", "pin\n"])
def test_no_call_without_a_declared_name(text):
    assert cut_call(text, TABLE) is None


def test_the_parser_returns_a_cut_call_only_when_told():
    text = "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lis"
    for cut in (True, False):
        parser = StreamingParser(TOOLS, thinking=False, cut_calls=cut)
        events = [*parser.feed(text[:20]), *parser.feed(text[20:]), *parser.finish()]
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = [e.call for e in events if isinstance(e, ToolCallParsed)]
        if cut:
            assert content == "Checking." and [c.name for c in calls] == ["get_weather"]
            assert calls[0].arguments == {"city": "Lis"}
        else:
            assert calls == [] and "<tool_call>" in content

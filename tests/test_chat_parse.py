"""parse_assistant: table of Ling 3 outputs and what a client must get from them."""

from __future__ import annotations

import json

import pytest

from ling3_rknn.chat import ParsedMessage, ToolCall, assistant_message, parse_assistant


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


READ = _tool("read", {"path": {"type": "string"}, "limit": {"type": "integer"}}, ["path"])
READ_FILE = _tool("read_file", {"file": {"type": "string"}}, ["file"])
BASH = _tool("bash", {"command": {"type": "string"}, "timeout": {"type": "number"}}, ["command"])
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters at all
TYPED = _tool(
    "typed",
    {
        "s": {"type": "string"},
        "n": {"type": "integer"},
        "f": {"type": "number"},
        "b": {"type": "boolean"},
        "o": {"type": "object"},
        "a": {"type": "array", "items": {"type": "string"}},
        "sn": {"type": ["string", "null"]},
        "in": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "e": {"enum": ["x", "y"]},
        "any": {},
    },
    [],
)
TOOLS = [READ, READ_FILE, BASH, NOW, TYPED]


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments)


def rc(path: str, extra: str = "") -> str:
    head = "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>"
    return f"{head}{path}</arg_value>{extra}\n</tool_call>"


def typed(key: str, raw: str) -> str:
    return f"<tool_call>typed\n<arg_key>{key}</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"


# (id, text, kwargs, reasoning, content, calls)
CASES = [
    ("reasoning_then_answer", "plan</think>Hello", {}, "plan", "Hello", []),
    ("never_closed_think_stays_reasoning", "still thinking", {}, "still thinking", "", []),
    ("thinking_off_plain", "Hello", {"thinking": False}, "", "Hello", []),
    ("thinking_off_but_think_block", "<think>r</think>c", {"thinking": False}, "r", "c", []),
    ("thinking_on_leading_think_consumed", "<think>r</think>c", {}, "r", "c", []),
    ("empty_reasoning", "</think>Hi", {}, "", "Hi", []),
    ("empty_output", "", {}, "", "", []),
    (
        "unclosed_think_tool_call",
        "need it" + rc("a.py"),
        {},
        "need it",
        "",
        [call("read", path="a.py")],
    ),
    ("closed_think_tool_call", "r</think>" + rc("a.py"), {}, "r", "", [call("read", path="a.py")]),
    (
        "content_before_call",
        "r</think>Let me look.\n" + rc("a.py"),
        {},
        "r",
        "Let me look.",
        [call("read", path="a.py")],
    ),
    (
        "content_before_call_two_newlines",
        "r</think>Look:\n\n" + rc("a"),
        {},
        "r",
        "Look:\n",
        [call("read", path="a")],
    ),
    (
        "only_newline_before_call_with_reasoning",
        "r</think>\n" + rc("a"),
        {},
        "r",
        "\n",
        [call("read", path="a")],
    ),
    (
        "parallel_calls",
        "r</think>" + rc("a") + "\n" + rc("b"),
        {},
        "r",
        "",
        [call("read", path="a"), call("read", path="b")],
    ),
    (
        "parallel_calls_no_separator",
        rc("a") + rc("b"),
        {"thinking": False},
        "",
        "",
        [call("read", path="a"), call("read", path="b")],
    ),
    (
        "parallel_off_takes_first",
        rc("a") + "\n" + rc("b"),
        {"thinking": False, "parallel_tool_calls": False},
        "",
        "\n" + rc("b"),
        [call("read", path="a")],
    ),
    (
        "trailing_prose_after_call",
        rc("a") + "\nDone.",
        {"thinking": False},
        "",
        "\nDone.",
        [call("read", path="a")],
    ),
    (
        "whitespace_after_last_call_dropped",
        rc("a") + "\n \n",
        {"thinking": False},
        "",
        "",
        [call("read", path="a")],
    ),
    (
        "role_end_after_call_dropped",
        rc("a") + "<|role_end|>",
        {"thinking": False},
        "",
        "",
        [call("read", path="a")],
    ),
    (
        "two_args_any_order",
        "<tool_call>read\n<arg_key>limit</arg_key>\n<arg_value>20</arg_value><arg_key>path</arg_key>"
        "\n<arg_value>x.py</arg_value>\n</tool_call>",
        {"thinking": False},
        "",
        "",
        [call("read", limit=20, path="x.py")],
    ),
    (
        "whitespace_between_tags_optional",
        "<tool_call> read <arg_key>path</arg_key><arg_value>a</arg_value>  <arg_key>limit</arg_key>"
        " <arg_value>3</arg_value></tool_call>",
        {"thinking": False},
        "",
        "",
        [call("read", path="a", limit=3)],
    ),
    (
        "newlines_everywhere_glm_style",
        "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n<arg_key>timeout</arg_key>"
        "\n<arg_value>2.5</arg_value>\n</tool_call>",
        {"thinking": False},
        "",
        "",
        [call("bash", command="ls", timeout=2.5)],
    ),
    ("zero_arg_call", "<tool_call>now\n\n</tool_call>", {"thinking": False}, "", "", [call("now")]),
    (
        "zero_arg_call_tight",
        "<tool_call>now</tool_call>",
        {"thinking": False},
        "",
        "",
        [call("now")],
    ),
    (
        "name_prefix_of_other_name",
        "<tool_call>read_file\n<arg_key>file</arg_key>\n<arg_value>f</arg_value>\n</tool_call>",
        {"thinking": False},
        "",
        "",
        [call("read_file", file="f")],
    ),
    (
        "undeclared_name_is_content",
        "<tool_call>rm\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        {"thinking": False},
        "",
        "<tool_call>rm\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        [],
    ),
    (
        "missing_required_is_content",
        "<tool_call>read\n<arg_key>limit</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        {"thinking": False},
        "",
        "<tool_call>read\n<arg_key>limit</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        [],
    ),
    (
        "duplicate_key_is_content",
        rc("a", "<arg_key>path</arg_key><arg_value>b</arg_value>"),
        {"thinking": False},
        "",
        rc("a", "<arg_key>path</arg_key><arg_value>b</arg_value>"),
        [],
    ),
    (
        "unknown_key_is_kept_json_typed",
        rc("a", "<arg_key>extra</arg_key><arg_value>5</arg_value>"),
        {"thinking": False},
        "",
        "",
        [call("read", path="a", extra=5)],
    ),
    (
        "incomplete_call_is_content",
        "ok\n<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a",
        {"thinking": False},
        "",
        "ok\n<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a",
        [],
    ),
    ("bare_open_tag_is_content", "<tool_call>   ", {"thinking": False}, "", "<tool_call>   ", []),
    (
        "empty_block_is_content",
        "<tool_call></tool_call>",
        {"thinking": False},
        "",
        "<tool_call></tool_call>",
        [],
    ),
    (
        "junk_then_valid_call",
        "<tool_call>bogus " + rc("a"),
        {"thinking": False},
        "",
        "<tool_call>bogus ",
        [call("read", path="a")],
    ),
    (
        "no_tools_no_call_parsing",
        "r<tool_call>read\n</tool_call>",
        {"tools": None},
        "r<tool_call>read\n</tool_call>",
        "",
        [],
    ),
    ("no_tools_content_keeps_tags", "</think>" + rc("a"), {"tools": []}, "", rc("a"), []),
    (
        "string_param_raw_untrimmed",
        rc("  123 \n"),
        {"thinking": False},
        "",
        "",
        [call("read", path="  123 \n")],
    ),
    (
        "string_param_keeps_json_looking_text",
        rc('{"a": 1}'),
        {"thinking": False},
        "",
        "",
        [call("read", path='{"a": 1}')],
    ),
    (
        "marker_like_strings_in_value",
        rc("<think></think><|role_end|><tool_call>x</tool_call><arg_key>"),
        {"thinking": False},
        "",
        "",
        [call("read", path="<think></think><|role_end|><tool_call>x</tool_call><arg_key>")],
    ),
    (
        "marker_like_value_in_unclosed_think",
        "r" + rc("</think>"),
        {},
        "r",
        "",
        [call("read", path="</think>")],
    ),
    ("typed_integer", typed("n", "20"), {"thinking": False}, "", "", [call("typed", n=20)]),
    (
        "typed_integer_negative",
        typed("n", "-7"),
        {"thinking": False},
        "",
        "",
        [call("typed", n=-7)],
    ),
    (
        "typed_integer_unparsable_stays_string",
        typed("n", "twenty"),
        {"thinking": False},
        "",
        "",
        [call("typed", n="twenty")],
    ),
    ("typed_number", typed("f", "3.14"), {"thinking": False}, "", "", [call("typed", f=3.14)]),
    (
        "typed_nan_stays_string",
        typed("f", "NaN"),
        {"thinking": False},
        "",
        "",
        [call("typed", f="NaN")],
    ),
    ("typed_bool", typed("b", "true"), {"thinking": False}, "", "", [call("typed", b=True)]),
    (
        "typed_object",
        typed("o", '{"k": [1, "ü"]}'),
        {"thinking": False},
        "",
        "",
        [call("typed", o={"k": [1, "ü"]})],
    ),
    (
        "typed_array",
        typed("a", '["x", "y"]'),
        {"thinking": False},
        "",
        "",
        [call("typed", a=["x", "y"])],
    ),
    (
        "string_or_null_null",
        typed("sn", "null"),
        {"thinking": False},
        "",
        "",
        [call("typed", sn=None)],
    ),
    (
        "string_or_null_number_stays_string",
        typed("sn", "123"),
        {"thinking": False},
        "",
        "",
        [call("typed", sn="123")],
    ),
    (
        "anyof_integer_null",
        typed("in", "4"),
        {"thinking": False},
        "",
        "",
        [call("typed", **{"in": 4})],
    ),
    ("enum_of_strings_raw", typed("e", "x"), {"thinking": False}, "", "", [call("typed", e="x")]),
    (
        "untyped_param_json_or_string",
        typed("any", "[1]") + typed("any", "hi"),
        {"thinking": False},
        "",
        "",
        [call("typed", any=[1]), call("typed", any="hi")],
    ),
    ("trailing_role_end_text_dropped", "r</think>Hi<|role_end|>", {}, "r", "Hi", []),
    ("role_end_in_reasoning_dropped", "r<|role_end|>", {}, "r", "", []),
    ("role_end_mid_text_kept", "</think>a<|role_end|>b", {}, "", "a<|role_end|>b", []),
    ("chinese_and_emoji", "想一想</think>你好 🙂", {}, "想一想", "你好 🙂", []),
    (
        "content_between_calls",
        rc("a") + "\nand then\n" + rc("b"),
        {"thinking": False},
        "",
        "\nand then",
        [call("read", path="a"), call("read", path="b")],
    ),
]


@pytest.mark.parametrize(
    ("text", "kwargs", "reasoning", "content", "calls"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_parse_table(text, kwargs, reasoning, content, calls):
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", TOOLS)
    got = parse_assistant(text, tools, **kwargs)
    assert got == ParsedMessage(reasoning, content, calls)


@pytest.mark.parametrize(
    ("text", "kwargs"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_nothing_is_lost(text, kwargs):
    """Every character ends up in reasoning, content or a call (or is a documented separator)."""
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", TOOLS)
    got = parse_assistant(text, tools, **kwargs)
    if not got.tool_calls:
        kept = got.reasoning + got.content
        removable = ("<think>", "</think>", "<|role_end|>")
        stripped = text
        for marker in removable:
            if marker in stripped and marker not in kept:
                stripped = stripped.replace(marker, "", 1)
        assert kept == stripped


def test_bare_function_tools_are_accepted():
    fn = {"name": "read", "parameters": {"properties": {"path": {"type": "string"}}}}
    assert parse_assistant(rc("a"), [fn], thinking=False).tool_calls == [call("read", path="a")]


def test_malformed_tool_entries_are_ignored():
    tools = ["x", {"type": "function"}, {"function": {"name": ""}}, READ]
    assert parse_assistant(rc("a"), tools, thinking=False).tool_calls == [call("read", path="a")]


def test_assistant_message_shape():
    parsed = ParsedMessage("why", "", [call("read", path="東京", limit=2)])
    msg = assistant_message(parsed, ids=["call_1"])
    assert msg == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "why",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read", "arguments": '{"path": "東京", "limit": 2}'},
            }
        ],
    }
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"path": "東京", "limit": 2}
    plain = assistant_message(ParsedMessage("", "hi", []))
    assert plain == {"role": "assistant", "content": "hi"}
    generated = assistant_message(ParsedMessage("", "", [call("now"), call("now")]))
    ids = [c["id"] for c in generated["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    with pytest.raises(ValueError):
        assistant_message(parsed, ids=[])


@pytest.mark.parametrize(("raw", "types", "want"), [
    ("5", {"number", "string"}, 5),
    ("5", {"integer", "string"}, 5),
    ("5.5", {"number", "string"}, 5.5),
    ("5.5", {"integer", "string"}, "5.5"),  # a float is not an integer: the raw text stays
    ("5", {"string", "null"}, "5"),
    ("five", {"number", "string"}, "five"),
])
def test_coerce_value_widens_integers_to_number_types(raw, types, want):
    """An integer literal is a JSON number, so a number-or-string parameter gets 5, not "5"."""
    from ling3_rknn.chat.tool_schema import coerce_value

    got = coerce_value(raw, frozenset(types))
    assert got == want and type(got) is type(want)

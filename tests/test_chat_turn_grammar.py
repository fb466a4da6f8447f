"""The turn grammar against hand-written token sequences, compiled by llguidance on the
compact test tokenizer: what it admits must parse into valid calls (or JSON), what it
refuses is what the issue forbids (undeclared or missing arguments, wrong types, a second
call, markers spelled as text), and a forced call re-renders to the ids it came from."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
from constrained_tools import ANSWER_SCHEMA, PING, SEARCH, TOOLS, WEATHER, check_calls

from ling3_rknn.chat import (
    GrammarError,
    assistant_message,
    parse_assistant,
    render_text,
    turn_grammar,
)
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


@pytest.fixture(scope="module")
def ll(tok) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tok.library_json(), n_vocab=tok.vocab_size,
                                  eos_token=tok.eos_id)


def ids(tok: Tokenizer, *pieces: str) -> list[int]:
    """Markers as their special ids, everything else as text."""
    special = tok.special_ids
    out: list[int] = []
    for piece in pieces:
        out += [special[piece]] if piece in special else tok.encode_text(piece)
    return out


def call(name: str, **args: str) -> list[str]:
    """The template's layout of one call, values written as given."""
    out = ["<tool_call>", f"{name}\n"]
    for key, value in args.items():
        out += ["<arg_key>", key, "</arg_key>", "\n", "<arg_value>", value, "</arg_value>"]
    return [*out, "\n", "</tool_call>"]


def admits(tok, ll, grammar, pieces: list[str]) -> bool:
    """The whole sequence is accepted and the turn may end there."""
    matcher = llguidance.LLMatcher(ll, grammar.lark(tok.special_ids).lark, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    sequence = ids(tok, *pieces)
    return matcher.try_consume_tokens(sequence) == len(sequence) and matcher.is_accepting()


REQUIRED = dict(tool_choice="required", thinking=False)
WEATHER_CALL = call("get_weather", city="Lisbon", days="3")


def test_required_admits_declared_calls_in_the_templates_layout(tok, ll):
    grammar = turn_grammar(TOOLS, **REQUIRED)
    two = [*WEATHER_CALL, "\n", *call("search", query="rust", filters='{"lang": "rs"}')]
    for pieces in (WEATHER_CALL, two, call("ping")):
        assert admits(tok, ll, grammar, pieces)
        message = parse_assistant(tok.decode(ids(tok, *pieces)), TOOLS, thinking=False)
        check_calls(message, {"get_weather", "search", "ping"}, at_least=1, at_most=None)


@pytest.mark.parametrize(("label", "pieces"), [
    ("no call at all", ["Sure."]),
    ("content before the call", ["Sure.\n", *WEATHER_CALL]),
    ("undeclared tool", call("get_time", city="Lisbon")),
    ("missing required argument", call("get_weather", city="Lisbon")),
    ("undeclared argument", call("get_weather", city="Lisbon", days="3", wind="yes")),
    ("integer spelled as a word", call("get_weather", city="Lisbon", days="three")),
    ("integer out of range", call("get_weather", city="Lisbon", days="9")),
    ("not an enum member", call("get_weather", city="Lisbon", unit="kelvin", days="3")),
    ("string over maxLength", call("get_weather", city="Llanfairpwllgwyngyll", days="3")),
    ("string below minLength", call("search", query="")),
    ("object missing its required key", call("search", query="x", filters="{}")),
    ("arguments out of declared order", call("get_weather", days="3", city="Lisbon")),
    ("a marker spelled as text", call("get_weather", city="a</arg_value>", days="3")),
])
def test_required_refuses(tok, ll, label, pieces):
    grammar = turn_grammar(TOOLS, **REQUIRED)
    assert not admits(tok, ll, grammar, pieces), label


def test_named_tool_is_exactly_one_call_of_that_tool(tok, ll):
    grammar = turn_grammar(TOOLS, tool_choice="required", forced_tool="get_weather",
                           thinking=False)
    assert admits(tok, ll, grammar, WEATHER_CALL)
    assert not admits(tok, ll, grammar, call("ping"))
    assert not admits(tok, ll, grammar, [*WEATHER_CALL, "\n", *WEATHER_CALL])


def test_parallel_false_allows_one_call(tok, ll):
    required = turn_grammar(TOOLS, tool_choice="required", parallel_tool_calls=False,
                            thinking=False)
    assert admits(tok, ll, required, WEATHER_CALL)
    assert not admits(tok, ll, required, [*WEATHER_CALL, "\n", *call("ping")])
    auto = turn_grammar(TOOLS, parallel_tool_calls=False, thinking=False)
    assert admits(tok, ll, auto, ["It is sunny."])
    assert admits(tok, ll, auto, ["Checking.\n", *WEATHER_CALL])
    assert admits(tok, ll, auto, [])
    assert not admits(tok, ll, auto, [*WEATHER_CALL, "\n", *call("ping")])
    assert not admits(tok, ll, auto, ["I will spell <tool_call> myself"])


def test_strict_tools_constrain_auto_calls(tok, ll):
    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, PING]
    grammar = turn_grammar(strict, thinking=False)
    assert grammar is not None
    assert admits(tok, ll, grammar, ["Let me check.\n", *WEATHER_CALL, "\n", *call("ping")])
    assert admits(tok, ll, grammar, ["No tool needed."])
    assert not admits(tok, ll, grammar, call("get_weather", city="Lisbon", days="soon"))


def test_reasoning_comes_first_when_thinking(tok, ll):
    grammar = turn_grammar(TOOLS, tool_choice="required")
    assert admits(tok, ll, grammar, ["The user wants weather.", "</think>", *WEATHER_CALL])
    assert admits(tok, ll, grammar, ["</think>", *WEATHER_CALL])
    assert not admits(tok, ll, grammar, WEATHER_CALL)  # the open <think> must be closed
    message = parse_assistant(
        tok.decode(ids(tok, "Weather, so.", "</think>", *WEATHER_CALL)), TOOLS)
    assert message.reasoning == "Weather, so." and message.tool_calls[0].name == "get_weather"


def test_response_format_is_json_for_the_schema(tok, ll):
    grammar = turn_grammar(None, response_schema=ANSWER_SCHEMA, thinking=False)
    good = json.dumps({"answer": "yes", "confidence": 0.5, "sources": [1, 2]})
    assert admits(tok, ll, grammar, [good])
    for bad in ('{"answer": "yes"}', '{"answer": "yes", "confidence": 2}',
                '{"answer": "yes", "confidence": 0.5, "extra": 1}', "yes"):
        assert not admits(tok, ll, grammar, [bad]), bad
    with_tools = turn_grammar([WEATHER], response_schema={"type": "object"}, thinking=False)
    assert admits(tok, ll, with_tools, ['{"a": 1}'])
    assert admits(tok, ll, with_tools, WEATHER_CALL)
    no_calls = turn_grammar([WEATHER], tool_choice="none", response_schema={"type": "object"},
                            thinking=False)
    assert not admits(tok, ll, no_calls, WEATHER_CALL)


def test_free_turns_get_no_grammar():
    assert turn_grammar(TOOLS, lazy_calls=False) is None  # auto, the lazy grammar declined
    assert turn_grammar(TOOLS, tool_choice="none") is None
    assert turn_grammar(None, parallel_tool_calls=False) is None
    assert turn_grammar(None) is None


def lazy_admits(tok, ll, grammar, pieces: list[str]) -> bool:
    """What a lazy grammar admits once entered: the pieces start at the trigger marker."""
    assert grammar.trigger == "<tool_call>" and pieces[0] == grammar.trigger
    return admits(tok, ll, grammar, pieces)


@pytest.mark.parametrize("thinking", [True, False])
def test_plain_auto_gets_the_lazy_grammar_of_its_calls(tok, ll, thinking):
    """From the opening marker on, a plain "auto" call is a "required" call: a declared
    tool, schema-valid arguments, more calls or the end; the text before it is not in the
    grammar at all (the engine enters it at the trigger)."""
    grammar = turn_grammar(TOOLS, thinking=thinking)
    assert grammar is not None and grammar.lazy
    two = [*WEATHER_CALL, "\n", *call("ping")]
    for pieces in (WEATHER_CALL, two):
        assert lazy_admits(tok, ll, grammar, pieces)
    for bad in (call("get_time", city="Lisbon"), call("get_weather", city="Lisbon"),
                call("get_weather", city="Lisbon", days="three"),
                [*WEATHER_CALL, "\nThe weather is"]):
        assert not lazy_admits(tok, ll, grammar, bad), bad
    one = turn_grammar(TOOLS, thinking=thinking, parallel_tool_calls=False)
    assert not one.lazy  # parallel_tool_calls false keeps its whole-turn grammar


def test_a_lazy_grammar_never_refuses_a_schema(tok, ll):
    """Every tool of an "auto" turn is lenient: a schema the grammar cannot follow gets
    free arguments instead of a 400 (the request used to be served unconstrained)."""
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "contentEncoding": "b"},
                                          "<bad>": {"type": "string"}}}}}
    grammar = turn_grammar([odd])
    assert grammar is not None
    assert lazy_admits(tok, ll, grammar, call("odd", anything="goes"))


def test_a_budget_bounds_a_forced_calls_free_strings(tok, ll):
    """With a budget, each raw string without maxLength of a forced call gets a token
    bound (a share of the budget), after which the grammar closes the value."""
    text_tool = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"title": {"type": "string"},
                                          "body": {"type": "string"},
                                          "tag": {"type": "string", "maxLength": 4}},
        "required": ["title", "body"]}}}
    forced = turn_grammar([text_tool], tool_choice="required", forced_tool="note",
                          thinking=False)
    assert forced.with_budget(10**6).bounds() == {"note": {"title": 262144, "body": 262144}}
    bounded = forced.with_budget(100)  # two unbounded strings: 100 // 3 -> 32 tokens each
    assert bounded.bounds() == {"note": {"title": 32, "body": 32}}
    assert forced.bounds() == {}  # no budget, no bound
    lark = bounded.lark(tok.special_ids).lark
    matcher = llguidance.LLMatcher(ll, lark, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    head = ids(tok, "<tool_call>", "note\n", "<arg_key>", "title", "</arg_key>", "\n",
               "<arg_value>")
    assert matcher.try_consume_tokens(head) == len(head)
    word = tok.encode_text("a")[0]
    taken = 0
    while matcher.try_consume_tokens([word]) == 1:
        taken += 1
        assert taken <= 32
    assert taken == 32 and matcher.compute_ff_tokens()[:1] == [tok.special_ids["</arg_value>"]]
    # under auto (lazy) no bound applies: a free string stays free
    assert turn_grammar([text_tool]).with_budget(100).bounds() == {}


@pytest.mark.parametrize(("kwargs", "part"), [
    (dict(tools=[WEATHER], tool_choice="required", forced_tool="nope"), "tool_choice"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
])
def test_impossible_choices_are_grammar_errors(kwargs, part):
    tools = kwargs.pop("tools")
    with pytest.raises(GrammarError) as info:
        turn_grammar(tools, **kwargs)
    assert info.value.part == part


@pytest.mark.parametrize(("schema", "part"), [
    ({"type": "string", "contentEncoding": "base64"}, ".properties.x"),
    ({"type": "string", "maxLength": -1}, ".properties.x"),
])
def test_unservable_string_parameters_name_the_parameter(schema, part):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}}}}
    with pytest.raises(GrammarError) as info:
        turn_grammar([tool], tool_choice="required")
    assert info.value.part == f"tools[0].function.parameters{part}"


def test_compile_errors_point_back_at_the_request_part(tok, ll):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "integer"}}}}}}
    text = turn_grammar([tool], tool_choice="required").lark(tok.special_ids)
    matcher = llguidance.LLMatcher(ll, text.lark, log_level=0)
    assert matcher.is_error()
    line = int(matcher.get_error().split("at ", 1)[1].split("(", 1)[0])
    assert text.part_at_line(line) == "tools[0].function.parameters.properties.x"


def test_a_forced_call_re_renders_to_the_generated_text(tok):
    """The template's own layout: the next turn's prompt carries the call as generated, so
    the prefix cache keeps the generated ids."""
    for pieces in (WEATHER_CALL, [*WEATHER_CALL, "\n", *call("ping")],
                   call("search", query="q", filters='{"lang": "py"}', tags='["a"]')):
        generated = tok.decode(ids(tok, *pieces))
        message = parse_assistant(generated, [WEATHER, SEARCH, PING], thinking=False)
        history = [{"role": "user", "content": "hi"}, assistant_message(message)]
        rendered = render_text(history, [WEATHER, SEARCH, PING], enable_thinking=False,
                               add_generation_prompt=False)
        assert rendered.endswith("<think></think>" + generated + "<|role_end|>")


def tool_with(properties: dict, required=(), **extra) -> dict:
    return {"type": "function", "function": {"name": "f", **extra, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


def test_refs_into_the_arguments_object_resolve(tok, ll):
    tree = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "label": {"type": "string", "maxLength": 8},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
            "same": {"$ref": "#/properties/label"}},
        "required": ["label", "children"]}}}
    grammar = turn_grammar([tree], **REQUIRED)
    assert admits(tok, ll, grammar, call("f", label="root",
                                         children='[{"label": "a", "children": []}]'))
    assert not admits(tok, ll, grammar, call("f", label="root", children="[[]]"))


@pytest.mark.parametrize("schema", [
    {"type": "string", "nullable": True, "x-order": 1},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "string", "contentEncoding": "base64"},
])
def test_auto_turns_never_refuse_what_they_served_unconstrained(tok, ll, schema):
    """parallel_tool_calls: false (or a strict sibling) constrains an "auto" turn; a
    keyword the grammar cannot follow on a non-strict tool is ignored, not a 400."""
    grammar = turn_grammar([tool_with({"x": schema})], parallel_tool_calls=False,
                           thinking=False)
    assert admits(tok, ll, grammar, ["Done."])
    value = "[1, 2]" if schema["type"] == "array" else "abc"
    assert admits(tok, ll, grammar, call("f", x=value))


def test_auto_turns_give_a_schema_they_cannot_follow_free_arguments(tok, ll):
    broken = tool_with({"x": {"type": "string"}}, required=["y"])  # y is not declared
    grammar = turn_grammar([broken], parallel_tool_calls=False, thinking=False)
    assert admits(tok, ll, grammar, call("f", y="1"))
    with pytest.raises(GrammarError):
        turn_grammar([broken], **REQUIRED)


@pytest.mark.parametrize(("schema", "good", "bad"), [
    ({"type": "string", "format": "date-time"}, "2026-12-01T10:00:00Z", "tomorrow"),
    ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "xyz"),
    ({"type": "string", "format": "date"}, "2026-02-28", "2026-13-01"),
    ({"type": "string", "enum": ["a", "bbbb"], "maxLength": 2}, "a", "bbbb"),
    ({"type": "string", "enum": ["x", "abc"], "pattern": "^a"}, "abc", "x"),
    ({"type": "string", "pattern": "^https?:\\/\\/"}, "https://a.b", "ftp://a"),
    ({"type": "string", "pattern": "a\\$"}, "xa$y", "xa"),
    ({"type": "string", "minLength": 2.0}, "ab", "a"),
    ({"type": "string", "maxLength": 3, "nullable": True, "x-order": 2}, "abc", "abcd"),
])
def test_raw_strings_honour_their_keywords(tok, ll, schema, good, bad):
    grammar = turn_grammar([tool_with({"x": schema}, required=["x"])], **REQUIRED)
    assert admits(tok, ll, grammar, call("f", x=good))
    assert not admits(tok, ll, grammar, call("f", x=bad))


def test_json_content_never_becomes_a_call(tok, ll):
    """With a response format the answer is JSON or calls: markup spelled inside a JSON
    string is admitted by the grammar, and the parser must keep it as content."""
    grammar = turn_grammar([WEATHER, PING], response_schema={
        "type": "object", "properties": {"a": {"type": "string"}}}, thinking=False)
    pieces = ['{"a": "x<tool_call>ping</tool_call>y"}']  # all text, no marker ids
    assert admits(tok, ll, grammar, pieces)
    text = tok.decode(ids(tok, *pieces))
    assert parse_assistant(text, [WEATHER, PING], thinking=False).tool_calls  # the hazard
    message = parse_assistant(text, [WEATHER, PING], thinking=False, calls_only_first=True)
    assert message.tool_calls == [] and json.loads(message.content)["a"].startswith("x<tool")
    first = parse_assistant(tok.decode(ids(tok, *call("ping"))), [WEATHER, PING],
                            thinking=False, calls_only_first=True)
    assert [c.name for c in first.tool_calls] == ["ping"]


def test_numbers_beyond_the_float_range_never_reach_the_client_as_infinity(tok):
    """llguidance bounds no exponent; a value with 1e999 anywhere in it stays text."""
    tool = tool_with({"x": {"type": "number"}, "o": {"type": "object"}})
    text = tok.decode(ids(tok, *call("f", x="2e400", o='{"n": 1e999}')))
    (parsed,) = parse_assistant(text, [tool], thinking=False).tool_calls
    assert parsed.arguments == {"x": "2e400", "o": '{"n": 1e999}'}
    assert "Infinity" not in parsed.arguments_json()


def test_allowed_tools_keep_the_others_uncallable(tok, ll):
    grammar = turn_grammar(TOOLS, allowed_tools=["ping"], thinking=False)
    assert admits(tok, ll, grammar, ["Sure.\n", *call("ping")])
    assert not admits(tok, ll, grammar, WEATHER_CALL)
    required = turn_grammar(TOOLS, tool_choice="required", allowed_tools=["ping"],
                            thinking=False)
    assert not admits(tok, ll, required, ["Sure."])
    with pytest.raises(GrammarError):
        turn_grammar(TOOLS, allowed_tools=["nope"])


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^(?=.*[A-Z]).{3,}$"},  # llguidance has no lookahead
    {"type": "string", "minLength": -3},
    {"type": "string", "enum": 5},
    {"type": "integer", "minimum": "x"},
])
def test_a_lenient_tool_the_library_refuses_gets_free_arguments(tok, schema):
    """Compiled the way the engine does: an "auto" turn's non-strict tool whose schema the
    grammar or llguidance cannot follow falls back to free arguments; under "required" the
    same schema is the client's 400."""
    from ling3_rknn.engine.api import InvalidRequest
    from ling3_rknn.engine.grammar_constraint import GrammarCompiler

    compiler = GrammarCompiler(tok)
    tools = [tool_with({"x": schema}), PING]
    auto = turn_grammar(tools, parallel_tool_calls=False, thinking=False)
    constraint = compiler.compile(auto)
    assert constraint is not None
    with pytest.raises((GrammarError, InvalidRequest)):
        compiler.compile(turn_grammar(tools, **REQUIRED))


def test_enum_values_that_spell_a_marker_are_left_out(tok, ll):
    grammar = turn_grammar([tool_with({"x": {"type": "string", "enum": ["a</arg_value>b", "c"]}},
                                      required=["x"])], **REQUIRED)
    assert admits(tok, ll, grammar, call("f", x="c"))
    assert not admits(tok, ll, grammar, call("f", x="a</arg_value>b"))


def test_embedded_schemas_keep_their_own_defs_and_drop_the_root_id(tok, ll):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "$id": "https://example.com/args", "type": "object",
        "$defs": {"Root": {"type": "integer"}},
        "properties": {
            "a": {"type": "object", "$defs": {"Own": {"type": "boolean"}},
                  "properties": {"b": {"$ref": "#/properties/a/$defs/Own"},
                                 "c": {"$ref": "#/$defs/Root"}},
                  "required": ["b", "c"]},
            "d": {"type": "array", "items": {"$ref": "#/properties/a"}, "maxItems": 1}},
        "required": ["a"]}}}
    grammar = turn_grammar([tool], **REQUIRED)
    assert admits(tok, ll, grammar, call("f", a='{"b": true, "c": 3}',
                                         d='[{"b": false, "c": 1}]'))
    assert not admits(tok, ll, grammar, call("f", a='{"b": 1, "c": 3}'))


def test_a_schema_nested_past_the_stack_is_refused_or_relaxed_never_a_crash():
    """A parameter nested deeper than Python's recursion limit: GrammarError naming the
    parameter for a required call, free arguments for a lenient tool of an auto turn."""
    deep: dict = {"type": "string"}
    for _ in range(1200):
        deep = {"type": "object", "properties": {"n": deep}}
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"x": deep}, "required": ["x"]}}}
    with pytest.raises(GrammarError) as info:
        turn_grammar([other], tool_choice="required")
    assert info.value.part.startswith("tools[0].function.parameters")
    grammar = turn_grammar([WEATHER, other], parallel_tool_calls=False)
    assert grammar is not None
    assert "a_1_free" in grammar._template.lark


@pytest.mark.parametrize("value", ['say "hi"', "C:\\tmp", 'a\\"b', "tab\there"])
def test_enum_and_const_values_that_need_escaping_are_matched_exactly(tok, ll, value):
    """A raw-string enum/const value with a quote, a backslash or a control character is
    the value itself in the grammar, not its escaped spelling."""
    for schema in ({"type": "string", "enum": [value, "other"]},
                   {"type": "string", "const": value}):
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": schema}, "required": ["x"]}}}
        grammar = turn_grammar([tool], tool_choice="required", thinking=False)
        assert admits(tok, ll, grammar, call("f", x=value))
        assert not admits(tok, ll, grammar, call("f", x=json.dumps(value)[1:-1] + "!"))
        assert not admits(tok, ll, grammar, call("f", x=json.dumps(value)))

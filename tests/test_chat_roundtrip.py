"""Round trip: generated text -> parse -> OpenAI message -> re-render == the generated text.

The engine's prefix cache only hits on the next turn if the assistant message a client sends
back re-renders to exactly the tokens the model generated. Generated texts here are the
template's own rendering of an assistant turn (its "normal generation shape"), so the test
covers every shape the template can produce from reasoning, content and calls.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ling3_rknn.chat import assistant_message, parse_assistant, render_text

ROLE_END = "<|role_end|>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "count": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "force": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "lines": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
                "required": ["path"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
HISTORY = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Fix the bug in 東京.py"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "look",
        "tool_calls": [
            {
                "id": "1",
                "type": "function",
                "function": {"name": "edit", "arguments": '{"path": "a"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": "ok"},
]

# Free text may contain tag-like pieces, but not a complete marker: a marker in free text
# legitimately changes the parse (that is what the markers are for).
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "</arg_value>", "<|role_end|>")
_chars = st.sampled_from(
    [
        *"ab Z.,:;!?'\"{}[]()=+-_/\\\t|<>",
        "\n",
        "\n\n",
        "é",
        "東",
        "🙂",
        "<think",
        "tool_call>",
        "<tool_",
        "</arg",
        "<arg_key>",
        "<|role_end",
        "<b>",
    ]
)
free_text = (
    st.lists(_chars, max_size=25).map("".join).filter(lambda s: not any(m in s for m in MARKERS))
)
# Reasoning that is empty or has real text: whitespace-only reasoning renders like none at all.
reasoning_text = free_text.filter(lambda s: s == "" or s.strip("\n") != "")
json_scalar = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.booleans(),
)
json_value = st.recursive(
    st.one_of(json_scalar, st.none(), free_text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def edit_call(draw) -> dict:
    args = {"path": draw(free_text)}
    optional = {
        "count": st.integers(-5, 10**9),
        "ratio": st.floats(allow_nan=False, allow_infinity=False),
        "force": st.booleans(),
        "opts": st.dictionaries(st.sampled_from(["x", "y", "東"]), json_value, max_size=3),
        "lines": st.lists(json_value, max_size=3),
        "note": st.one_of(st.none(), free_text.filter(lambda s: not _is_json(s))),
    }
    for key in draw(st.permutations(list(optional))):
        if draw(st.booleans()):
            args[key] = draw(optional[key])
    items = list(args.items())
    order = draw(st.permutations(range(len(items))))
    return {"name": "edit", "arguments": {items[i][0]: items[i][1] for i in order}}


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


call_strategy = st.one_of(edit_call(), st.just({"name": "now", "arguments": {}}))


@st.composite
def assistant_turn(draw, thinking: bool) -> dict:
    msg: dict = {"role": "assistant", "content": draw(free_text)}
    if thinking:
        msg["reasoning_content"] = draw(reasoning_text)
    calls = draw(st.lists(call_strategy, max_size=3))
    if calls:
        msg["tool_calls"] = [
            {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for i, c in enumerate(calls)
        ]
    return msg


def _generated_text(history: list, turn: dict, thinking: bool) -> str:
    """What the model generated for ``turn``: its rendering after the generation prompt."""
    prompt = render_text(history, TOOLS, enable_thinking=thinking)
    full = render_text(
        [*history, turn], TOOLS, enable_thinking=thinking, add_generation_prompt=False
    )
    assert full.startswith(prompt) and full.endswith(ROLE_END)
    return full[len(prompt) : -len(ROLE_END)]


def _assert_round_trip(history: list, generated: str, thinking: bool) -> None:
    prompt = render_text(history, TOOLS, enable_thinking=thinking)
    parsed = parse_assistant(generated, TOOLS, thinking=thinking)
    message = assistant_message(parsed)
    # What clients send back: JSON over the wire.
    message = json.loads(json.dumps(message))
    again = render_text(
        [*history, message], TOOLS, enable_thinking=thinking, add_generation_prompt=False
    )
    assert again == prompt + generated + ROLE_END


@settings(max_examples=150, deadline=None)
@given(assistant_turn(thinking=True))
def test_round_trip_thinking_on(turn):
    _assert_round_trip(HISTORY, _generated_text(HISTORY, turn, True), True)


@settings(max_examples=80, deadline=None)
@given(assistant_turn(thinking=False))
def test_round_trip_thinking_off(turn):
    _assert_round_trip(HISTORY, _generated_text(HISTORY, turn, False), False)


@pytest.mark.parametrize(
    "generated",
    [
        "I should read it.</think>" + "<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>a.py"
        "</arg_value><arg_key>count</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "plan</think>Reading both.\n<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>a"
        "</arg_value>\n</tool_call>\n<tool_call>now\n\n</tool_call>",
        "</think>Just an answer.",
        "plan</think>\n<tool_call>now\n\n</tool_call>",
        "plan</think>Done.\n\n",
    ],
)
def test_round_trip_typical_generations(generated):
    _assert_round_trip(HISTORY, generated, True)


def test_round_trip_needs_the_separator_rules():
    """The one-newline separator is not content: keeping it would add a newline per turn."""
    generated = "r</think>Text\n<tool_call>now\n\n</tool_call>"
    parsed = parse_assistant(generated, TOOLS)
    assert parsed.content == "Text"

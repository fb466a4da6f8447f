"""Generated-id reuse when the template normalises the model's own spacing.

The model may write ``</think>\\n\\n`` before its answer; the template strips those newlines
when the client sends the turn back, so the next prompt's text differs from what was
generated. With the request's parser (whose ``history_text()`` is the chat layer's canonical
re-rendering of what it parsed while streaming) the engine still reuses the generated ids
and the whole first turn comes from the prefix cache.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from engine_doubles import ScriptedModel, answer_script
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_fixtures import READ_TOOLS

from ling3_rknn import chat
from ling3_rknn.chat.segments import Segment
from ling3_rknn.engine import Engine, EngineOptions, Finished, GenerationRequest, SamplingParams
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
GREEDY = SamplingParams(temperature=0.0)
TURN1 = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to the world, please."},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


def generated_ids(tok: Tokenizer) -> list[int]:
    """Reasoning, the real ``</think>`` token, then an answer led by two newlines."""
    pieces = [Segment("I greet.", False), Segment("</think>", True), Segment("\n\nHello!", False)]
    return tok.encode_segments(pieces)


async def two_turns(tok: Tokenizer, with_history_form: bool) -> tuple[Finished, Finished, int]:
    think = tok.special_ids["<think>"]
    answer = generated_ids(tok)
    model = ScriptedModel(tok.vocab_size, answer_script(answer, think, tok.eos_id))
    engine = Engine(model, tok,
                    EngineOptions(model_id="t", max_context=1024, checkpoint_min_tokens=0))
    form = functools.partial(chat.StreamingParser, thinking=True) if with_history_form else None

    async def run(messages: list[dict]) -> Finished:
        request = GenerationRequest(chat.render(messages), GREEDY, parser=form)
        events = [e async for e in engine.generate(request)]
        assert isinstance(events[-1], Finished)
        return events[-1]

    with engine:
        first = await run(TURN1)
        reply = chat.assistant_message(chat.parse_assistant(first.text, thinking=True))
        second = await run([*TURN1, reply, {"role": "user", "content": "Again."}])
    turn1_tokens = first.usage.prompt_tokens + len(answer) + 1  # + the end-of-turn marker
    return first, second, turn1_tokens


async def test_generated_spacing_is_normalised_by_the_template(tok):
    first, _, _ = await two_turns(tok, with_history_form=True)
    assert first.text == "I greet.</think>\n\nHello!"
    assert chat.history_text(first.text) == "I greet.</think>Hello!"


async def test_canonical_history_reuses_the_whole_first_turn(tok):
    _, second, turn1_tokens = await two_turns(tok, with_history_form=True)
    assert second.usage.cached_tokens == turn1_tokens


async def test_without_the_canonical_form_the_turn_is_not_reused(tok):
    _, second, turn1_tokens = await two_turns(tok, with_history_form=False)
    assert second.usage.cached_tokens < turn1_tokens


def test_history_text_refuses_what_the_template_cannot_reproduce():
    # thinking off, but the model opened a reasoning block anyway: the re-rendered turn
    # no longer starts with the generation prompt, so there is no canonical form.
    assert chat.history_text("<think>x</think>y", thinking=False) is None
    assert chat.history_text("plain answer", thinking=False) == "plain answer"


# -- the one-render form is the old two-render diff -------------------------------------

TOOLS = READ_TOOLS
_ANCHOR = [{"role": "user", "content": "."}]
_PIECES = [
    "<think>", "</think>", "\n", "\n\n", " ", "text", "東京", "<|role_end|>", "<tool_call>",
    "read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>",
    "read\n<arg_key>limit</arg_key><arg_value>2</arg_value><arg_key>path</arg_key>"
    "<arg_value>b</arg_value></tool_call>",
    "nope</tool_call>", "<arg_key>", "</arg_value>",
]


def two_render_form(text: str, tools: object, thinking: bool) -> str | None:
    """What the engine used before: parse the whole text again, build the client's
    message and diff two renders of a one-message conversation."""
    parsed = chat.parse_assistant(text, tools, thinking=thinking)
    message = chat.assistant_message(parsed, ids=[f"c{i}" for i in range(len(parsed.tool_calls))])
    try:
        head = chat.render_text(_ANCHOR, enable_thinking=thinking, add_generation_prompt=True)
        full = chat.render_text(
            [*_ANCHOR, message], enable_thinking=thinking, add_generation_prompt=False
        )
    except chat.ChatFormatError:
        return None
    if not full.startswith(head) or not full.endswith("<|role_end|>"):
        return None
    return full[len(head) : -len("<|role_end|>")]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=8),
    cut=st.integers(0, 200),
    thinking=st.booleans(),
    with_tools=st.booleans(),
)
def test_streamed_history_form_equals_the_two_render_diff(pieces, cut, thinking, with_tools):
    text = "".join(pieces)
    tools = TOOLS if with_tools else None
    parser = chat.StreamingParser(tools, thinking=thinking)
    cut %= len(text) + 1
    parser.feed(text[:cut])
    parser.feed(text[cut:])
    parser.finish()
    assert parser.history_text() == two_render_form(text, tools, thinking)
    assert chat.history_text(text, tools, thinking=thinking) == parser.history_text()

"""Call markup that cannot leak: the real engine on the numpy model with random weights,
*tempted* (its call markers' logits raised) so that it opens calls all the time, with the
requests the server builds (``server.completion.generation_request``).

Whatever the seed and sampling settings: with no tools, or ``tool_choice: "none"``, no
answer contains a call marker; under ``auto`` every call names a declared tool with
schema-valid arguments and the content never holds call markup; a forced call cut by
``max_tokens`` comes back as a call."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from constrained_tools import TOOLS, check_calls
from engine_doubles import DelegatingModel
from engine_tiny_model import make_tiny_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ling3_rknn.chat import ContentDelta, Finished, ReasoningDelta, ToolCallParsed, markers
from ling3_rknn.engine import Engine, EngineOptions
from ling3_rknn.engine.call_guard import BanRows, MarkerBan
from ling3_rknn.model import Model
from ling3_rknn.server.completion import generation_request, render_prompt
from ling3_rknn.server.validate import parse_chat_request
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
NAMES = {t["function"]["name"] for t in TOOLS}
UNDECLARED = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Tempted(DelegatingModel):
    """The real model with ``boost`` added to the logits of ``ids``: a model that keeps
    opening calls (and writing call markup) unless something stops it."""

    def __init__(self, model: Model, ids: list[int], boost: float) -> None:
        super().__init__(model)
        self._ids = ids
        self._boost = np.float32(boost)

    def forward(self, token_ids, state, *, last_only: bool = False):
        out = super().forward(token_ids, state, last_only=last_only).copy()
        out[:, self._ids] += self._boost
        return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    return Model.from_hf(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def engine(tiny, tok):
    tempted = Tempted(tiny, [tok.special_ids[m] for m in markers.CALL_MARKERS], 6.0)
    engine = Engine(tempted, tok,
                    EngineOptions(model_id="tiny", max_context=2048, checkpoint_min_tokens=8))
    yield engine
    engine.close()


SAMPLING = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    "top_k": st.sampled_from([None, 5, 40]),
    "top_p": st.sampled_from([None, 0.95]),
    "seed": st.integers(0, 2**31),
})


async def answer(engine, body: dict) -> tuple[Finished, list[str], list]:
    """The server's request for ``body`` through the engine: (Finished, content deltas,
    calls)."""
    request = parse_chat_request({"model": "tiny", **body})
    events = [e async for e in engine.generate(
        generation_request(request, render_prompt(request)))]
    await engine.idle()
    content = [e.text for e in events if isinstance(e, ContentDelta | ReasoningDelta)]
    calls = [e.call for e in events if isinstance(e, ToolCallParsed)]
    assert isinstance(events[-1], Finished)
    return events[-1], content, calls


def no_markup(texts: list[str]) -> None:
    for text in texts:
        assert not any(m in text for m in markers.CALL_MARKERS), text


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=SAMPLING, thinking=st.booleans(), tools=st.sampled_from(["none", "absent"]))
async def test_no_call_markers_where_no_call_is_possible(engine, sampling, thinking, tools):
    body = {"messages": [{"role": "user", "content": "What is the weather in Lisbon?"}],
            "max_tokens": 40, "reasoning_effort": None if thinking else "none", **sampling}
    if tools == "none":
        body.update(tools=TOOLS, tool_choice="none")
    finished, content, calls = await answer(engine, body)
    assert calls == []
    no_markup([finished.text, *content])


@settings(max_examples=16, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=SAMPLING, thinking=st.booleans())
async def test_auto_calls_name_declared_tools_with_valid_arguments(engine, sampling, thinking):
    body = {"messages": [{"role": "user", "content": "How warm is it in London today?"}],
            "tools": TOOLS, "max_tokens": 96, "reasoning_effort": None if thinking else "none",
            **sampling}
    finished, content, calls = await answer(engine, body)
    no_markup(content)
    assert all(c.name in NAMES for c in calls), calls
    complete = calls[:-1] if finished.finish_reason == "length" else calls
    check_calls(type("M", (), {"tool_calls": complete})(), NAMES, at_least=0, at_most=None)


async def test_the_tempted_model_does_open_calls(engine):
    """The temptation works: under auto most answers are calls (else the property tests
    above would prove little)."""
    made = 0
    for seed in range(6):
        _, _, calls = await answer(engine, {
            "messages": [{"role": "user", "content": "Weather in Porto?"}], "tools": TOOLS,
            "max_tokens": 96, "seed": seed, "reasoning_effort": "none"})
        made += bool(calls)
    assert made >= 4


async def test_an_undeclared_tool_cannot_be_called(engine, tok):
    """With the undeclared tool's name boosted too, a call still names a declared one."""
    name_ids = tok.encode_text("get_forecast")
    tempted = engine.model
    saved = tempted._ids
    tempted._ids = [*saved, *name_ids]
    try:
        for seed in range(4):
            finished, content, calls = await answer(engine, {
                "messages": [{"role": "user", "content": "How warm is it in London today?"}],
                "tools": TOOLS, "max_tokens": 96, "seed": seed, "reasoning_effort": "none"})
            no_markup(content)
            assert all(c.name in NAMES for c in calls) and "get_forecast" not in finished.text
    finally:
        tempted._ids = saved


async def test_a_forced_call_cut_by_max_tokens_is_a_call(engine):
    finished, content, calls = await answer(engine, {
        "messages": [{"role": "user", "content": "Weather in Porto?"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 9, "temperature": 0, "reasoning_effort": "none"})
    assert finished.finish_reason == "length" and content == []
    (call,) = calls
    assert call.name == "get_weather"


async def test_a_forced_string_never_closed_ends_at_its_bound(tiny, tok):
    """LangChain's structured output: a named tool_choice and no max_tokens, and a model
    that never closes the string. The engine's default cap is the budget; the string is
    cut at its share of it (128 // 2 -> 64 tokens), the call ends, finish_reason says
    "length", and the arguments are what was generated."""
    stubborn = Tempted(tiny, [tok.special_ids["</arg_value>"]], -1e4)
    capped = Engine(stubborn, tok,
                    EngineOptions(model_id="tiny", max_context=2048, default_max_tokens=128))
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    with capped:
        finished, content, calls = await answer(capped, {
            "messages": [{"role": "user", "content": "Write a note."}], "tools": [note],
            "tool_choice": {"type": "function", "function": {"name": "note"}},
            "temperature": 1.0, "seed": 3, "reasoning_effort": "none"})
    (call,) = calls
    assert call.name == "note" and call.arguments["text"]
    assert content == [] and finished.finish_reason == "length"
    assert finished.usage.completion_tokens < 128  # the bound ended it, not the cap
    assert finished.text.endswith("</tool_call>")


async def test_a_request_without_max_tokens_gets_the_default_cap(tiny, tok):
    capped = Engine(tiny, tok,
                    EngineOptions(model_id="tiny", max_context=2048, default_max_tokens=7))
    with capped:
        finished, _, _ = await answer(capped, {
            "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0,
            "seed": 1, "reasoning_effort": "none", "stop": None})
        assert finished.usage.completion_tokens <= 7
        finished, _, _ = await answer(capped, {
            "messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
            "max_tokens": 9, "reasoning_effort": "none"})
        assert finished.usage.completion_tokens <= 9


async def test_a_lazy_grammar_that_breaks_mid_call_leaves_the_turn_free(tiny, tok, caplog):
    """A pattern that exceeds llguidance's limits while generating fails a forced request
    (test_engine_constrained); under auto the rest of the turn goes on unconstrained."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string",
                                               "pattern": "^([a-z]+\\d?){1,2000}$"}},
        "required": ["x"]}}}
    opener = Tempted(tiny, [tok.special_ids["<tool_call>"]], 8.0)  # opens, never closes
    with Engine(opener, tok, EngineOptions(model_id="tiny", max_context=2048)) as calling:
        for sampling in ({"temperature": 0}, {"temperature": 0.7, "seed": 1}):
            finished, _, _ = await answer(calling, {
                "messages": [{"role": "user", "content": "Go."}], "tools": [tool],
                "max_tokens": 200, "reasoning_effort": "none", **sampling})
            assert finished.finish_reason in ("stop", "length")
    assert "the call grammar broke mid-call" in caplog.text  # the case was exercised


def test_the_ban_is_one_cached_row(tok):
    rows = BanRows()
    ban = MarkerBan(rows, [tok.special_ids[m] for m in markers.CALL_MARKERS])
    logits = np.zeros(tok.vocab_size, np.float32)
    masked = ban.mask(logits)
    assert np.isneginf(masked[tok.special_ids["<tool_call>"]]) and masked[100] == 0
    assert not np.isneginf(logits).any()  # the row it was given is untouched
    assert rows.row(ban._ids, tok.vocab_size) is rows.row(ban._ids, tok.vocab_size)


@pytest.fixture(scope="module")
def thinker(tiny, tok):
    """A model that keeps writing reasoning markers unless something stops it."""
    tempted = Tempted(tiny, [tok.special_ids[m] for m in (markers.THINK_OPEN,
                                                          markers.THINK_CLOSE)], 6.0)
    with Engine(tempted, tok, EngineOptions(model_id="tiny", max_context=2048)) as engine:
        yield engine


@pytest.mark.parametrize("tools", [None, "auto", "none"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
async def test_reasoning_markers_are_spent_by_the_prompt(thinker, thinking, tools):
    """The generation prompt opens the reasoning (thinking off: opens and closes it), so
    an answer never opens it again and closes it at most once, whatever the model wants;
    no reasoning marker reaches the content (a demo answer leaked ``</think>``)."""
    body = {"messages": [{"role": "user", "content": "Weather in Porto?"}],
            "max_tokens": 48, "reasoning_effort": None if thinking else "none"}
    if tools:
        body.update(tools=TOOLS, tool_choice=tools)
    closes = 0
    for seed in range(3):
        finished, texts, _ = await answer(thinker, {**body, "temperature": 0.8, "seed": seed})
        assert markers.THINK_OPEN not in finished.text
        closes += finished.text.count(markers.THINK_CLOSE)
        assert finished.text.count(markers.THINK_CLOSE) <= (1 if thinking else 0)
        for delta in texts:  # the reasoning and content the client sees
            assert markers.THINK_CLOSE not in delta and markers.THINK_OPEN not in delta
    if thinking:
        assert closes >= 1  # the temptation works: the one close was taken


async def test_the_thinker_would_repeat_reasoning_markers(thinker, tok):
    """Unguarded (a request with no marker lists), the tempted model writes reasoning
    markers again and again, so the test above proves the guard."""
    request = parse_chat_request({"model": "tiny", "max_tokens": 48, "temperature": 0.8,
                                  "seed": 0, "messages": [{"role": "user", "content": "Hi"}]})
    raw = dataclasses.replace(generation_request(request, render_prompt(request)),
                              banned_markers=(), once_markers=())
    events = [e async for e in thinker.generate(raw)]
    await thinker.idle()
    text = events[-1].text
    assert text.count(markers.THINK_CLOSE) + text.count(markers.THINK_OPEN) >= 2, text

"""Constrained decoding through the real engine: the numpy model with random weights (which
has no idea what a tool call is), the compact tokenizer, llguidance masks. Whatever the seed,
temperature or truncation settings, a constrained turn must parse into valid calls of the
allowed tools with schema-valid arguments, or into JSON valid for the response schema."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from constrained_tools import ANSWER_SCHEMA, TOOLS, check_calls
from engine_tiny_model import make_tiny_checkpoint
from fp_bounds import model_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ling3_rknn.chat import (
    Finished,
    StreamingParser,
    ToolCallParsed,
    assistant_message,
    parse_assistant,
    render,
    turn_grammar,
)
from ling3_rknn.engine import (
    Engine,
    EngineOptions,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
)
from ling3_rknn.model import Model
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
USER = {"role": "user", "content": "What is the weather in Lisbon?"}
NAMES = {t["function"]["name"] for t in TOOLS}


class CallCounter:
    """Delegates to the real model and records how many ids each forward call carried."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self.config = model.config
        self.calls: list[int] = []

    def new_state(self):
        return self._model.new_state()

    def forward(self, token_ids, state, *, last_only: bool = False):
        self.calls.append(len(token_ids))
        return self._model.forward(token_ids, state, last_only=last_only)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> CallCounter:
    return CallCounter(Model.from_hf(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, Tokenizer.from_file(TOKENIZER),
                    EngineOptions(model_id="tiny", max_context=2048, checkpoint_min_tokens=8))
    yield engine
    engine.close()


DEFAULT_SAMPLING = SamplingParams()


async def constrained(engine, messages, *, tools=TOOLS, sampling=DEFAULT_SAMPLING,
                      max_tokens=160, **choice):
    """One turn with the grammar the server would build; returns (Finished, calls)."""
    request = GenerationRequest(
        render(messages, tools, enable_thinking=False), sampling, max_tokens=max_tokens,
        parser=functools.partial(StreamingParser, tools, thinking=False,
                                 parallel_tool_calls=choice.get("parallel_tool_calls", True)),
        grammar=turn_grammar(tools, thinking=False, **choice),
    )
    events = [e async for e in engine.generate(request)]
    await engine.idle()
    finished = events[-1]
    assert isinstance(finished, Finished)
    return finished, [e.call for e in events if isinstance(e, ToolCallParsed)]


MODES = {
    "named": (dict(tool_choice="required", forced_tool="get_weather"), {"get_weather"}, 1, 1),
    "required": (dict(tool_choice="required"), NAMES, 1, None),
    "required, one call": (dict(tool_choice="required", parallel_tool_calls=False), NAMES, 1, 1),
    "auto, one call": (dict(parallel_tool_calls=False), NAMES, 0, 1),
}
SAMPLING = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    top_k=st.sampled_from([None, 1, 5, 40]),
    top_p=st.sampled_from([None, 0.5, 0.95]),
    min_p=st.sampled_from([None, 0.1]),
    repetition_penalty=st.sampled_from([None, 1.3]),
    seed=st.integers(0, 2**31),
)


@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=SAMPLING)
async def test_forced_calls_are_valid_whatever_the_sampling(engine, mode, sampling):
    choice, allowed, at_least, at_most = MODES[mode]
    # free content rarely ends by itself with random weights: a short limit keeps it cheap
    limit = 48 if mode.startswith("auto") else 160
    finished, calls = await constrained(engine, [USER], sampling=sampling, max_tokens=limit,
                                        **choice)
    message = parse_assistant(finished.text, TOOLS, thinking=False,
                              parallel_tool_calls=choice.get("parallel_tool_calls", True))
    assert [c.name for c in message.tool_calls] == [c.name for c in calls]
    if finished.finish_reason == "length":
        # max_tokens cut the turn (free content, or a model that keeps adding parallel
        # calls): whatever was completed is still valid and never exceeds the count.
        assert at_most is None or at_most > 1 or mode.startswith("auto")
        check_calls(message, allowed, at_least=0, at_most=at_most)
        return
    assert finished.finish_reason == "stop", finished.text
    check_calls(message, allowed, at_least=at_least, at_most=at_most)
    if at_least:
        assert message.content == "", finished.text


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=SAMPLING)
async def test_response_format_is_valid_json_whatever_the_sampling(engine, sampling):
    finished, calls = await constrained(engine, [USER], tools=None, sampling=sampling,
                                        tool_choice="none", response_schema=ANSWER_SCHEMA)
    assert finished.finish_reason == "stop" and calls == []
    jsonschema.validate(json.loads(finished.text), ANSWER_SCHEMA)


async def test_forced_tokens_share_one_model_call(engine, model):
    """After ``<tool_call>`` the named tool's name and first key are forced: the engine
    evaluates them together instead of sampling each."""
    greedy = SamplingParams(temperature=0)
    await constrained(engine, [USER], sampling=greedy)  # the prompt is in the cache now
    model.calls.clear()
    finished, calls = await constrained(engine, [USER], sampling=greedy,
                                        tool_choice="required", forced_tool="get_weather")
    assert calls and finished.finish_reason == "stop"
    assert finished.usage.cached_tokens == finished.usage.prompt_tokens
    # every generated token evaluated once (the last, <|role_end|>, by the end-of-turn
    # snapshot), in fewer calls than tokens
    assert sum(model.calls) == finished.usage.completion_tokens
    assert max(model.calls) > 3 and len(model.calls) < finished.usage.completion_tokens


async def test_a_limit_inside_a_forced_run_leaves_a_correct_end_of_turn_snapshot(engine, model):
    """max_tokens cuts a run of forced ids that were never evaluated: the end-of-turn
    snapshot must evaluate them (and the end marker) before it is stored."""
    messages = [{"role": "user", "content": "Weather in Porto, please."}]
    finished, _ = await constrained(engine, messages, sampling=SamplingParams(temperature=0),
                                    max_tokens=3, tool_choice="required",
                                    forced_tool="get_weather")
    assert finished.finish_reason == "length" and finished.usage.completion_tokens == 3
    tok = Tokenizer.from_file(TOKENIZER)
    prompt = tok.encode_segments(render(messages, TOOLS, enable_thinking=False))
    generated = [tok.special_ids["<tool_call>"], *tok.encode_text("get_weather")][:3]
    assert tok.decode(generated) == finished.text
    path = [*prompt, *generated, tok.eos_id]
    hit = engine._cache.lookup(path)
    assert hit is not None and hit.depth == len(path)
    cold = model._model.forward(path, model._model.new_state(), last_only=True)[-1]
    # the cached path's logits against one cold call: two float32 evaluations (fp_bounds.py)
    tol = model_error(model._model.config, len(path), float(np.abs(cold).max()))
    np.testing.assert_allclose(hit.logits, cold, rtol=0, atol=tol)


async def test_a_forced_turn_is_reused_by_the_next_turn(engine):
    """The grammar writes the template's layout, so the next request, carrying the call
    back, hits the prefix cache past the end of the generated turn."""
    greedy = SamplingParams(temperature=0)
    first, _ = await constrained(engine, [USER], sampling=greedy, tool_choice="required",
                                 forced_tool="get_weather")
    message = parse_assistant(first.text, TOOLS, thinking=False)
    history = [USER, assistant_message(message),
               {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    second, _ = await constrained(engine, history, sampling=greedy, tool_choice="required",
                                  forced_tool="get_weather")
    covered = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.cached_tokens >= covered


async def test_a_grammar_the_library_cannot_compile_is_invalid_request(engine):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "integer"}}}}}}
    with pytest.raises(InvalidRequest, match=r"tools\[0\].function.parameters.properties.x"):
        await constrained(engine, [USER], tools=[tool], tool_choice="required")
    # the engine is untouched: the next request runs
    _, calls = await constrained(engine, [USER], tool_choice="required",
                                 forced_tool="get_weather")
    assert calls


async def test_a_lazy_grammar_the_library_cannot_compile_serves_unconstrained(
        engine, caplog, monkeypatch):
    """Under plain auto the grammar only guards calls that used to be free: one the library
    refuses (whatever the reason) leaves the turn unconstrained with one warning instead of
    refusing the request; a full grammar's refusal is still the client's 400."""
    grammar = turn_grammar(TOOLS, thinking=False)
    assert grammar is not None and grammar.trigger is not None  # auto: lazy

    def refuse(_grammar):
        raise InvalidRequest("the constraint library refused this schema", "tools[0]")

    monkeypatch.setattr(engine._grammars, "compile", refuse)
    caplog.set_level("WARNING")
    finished, _ = await constrained(engine, [USER], max_tokens=8)
    assert finished.finish_reason in ("stop", "length", "tool_calls")
    assert any("calls stay unconstrained" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidRequest):
        await constrained(engine, [USER], tool_choice="required")


async def test_a_tokenizer_the_library_cannot_read_refuses_constraints(model):
    class Unreadable:
        """The real tokenizer, but its tokens' bytes come back as text: llguidance cannot
        build its view of it."""

        def __init__(self, tok: Tokenizer) -> None:
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def token_bytes(self, token_id: int) -> str:
            return self._tok.decode([token_id])

    plain = Engine(model, Unreadable(Tokenizer.from_file(TOKENIZER)),
                   EngineOptions(model_id="t", max_context=2048))
    with plain, pytest.raises(InvalidRequest, match="not available"):
        await constrained(plain, [USER], tool_choice="required")


# -- the trained demo model ------------------------------------------------------------------

DEMO_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"]}}}
    for name in ("get_weather", "get_time")
]


@pytest.fixture(scope="module")
def demo_engine():
    from ling3_rknn.demo import load_demo_engine

    engine = load_demo_engine()
    yield engine
    engine.close()


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=SAMPLING, question=st.sampled_from([
    "What's the weather like in Lisbon?", "Hello! Who are you?", "Tell me a joke.",
    "What time is it in Tokyo?"]), named=st.booleans())
async def test_the_demo_model_forced_is_valid_whatever_the_sampling(
        demo_engine, sampling, question, named):
    forced = "get_time" if named else None
    finished, calls = await constrained(
        demo_engine, [{"role": "user", "content": question}], tools=DEMO_TOOLS,
        sampling=sampling, max_tokens=64, tool_choice="required", forced_tool=forced,
        parallel_tool_calls=False)
    assert finished.finish_reason == "stop", finished.text
    (call,) = calls
    assert call.name == (forced or call.name) and call.name in {"get_weather", "get_time"}
    jsonschema.validate(call.arguments, {**DEMO_TOOLS[0]["function"]["parameters"],
                                         "additionalProperties": False})


async def test_a_grammar_that_breaks_while_generating_is_invalid_request(engine):
    """Some grammars compile and only exceed llguidance's limits mid-answer, depending on
    what was sampled: that request gets InvalidRequest (a 400: the grammar is at fault, not
    the model), and the engine goes on serving."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string",
                                               "pattern": "^([a-z]+\\d?){1,2000}$"}},
        "required": ["x"]}}}
    with pytest.raises(InvalidRequest, match="limits while generating"):
        await constrained(engine, [USER], tools=[tool], tool_choice="required",
                          sampling=SamplingParams(temperature=0), max_tokens=200)
    _, calls = await constrained(engine, [USER], tool_choice="required",
                                 forced_tool="get_weather")
    assert calls  # the engine serves the next request


def test_a_call_right_after_the_reasoning_is_not_counted_as_reasoning():
    from ling3_rknn.chat import TextDelta
    from ling3_rknn.engine.parsed_turn import ParsedTurn

    turn = ParsedTurn(functools.partial(StreamingParser, TOOLS, thinking=True))
    deltas = [("Weather", 1), (" it is", 2), ("</think>", 1), ("<tool_call>", 1),
              ("get_weather\n", 3), ("<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>", 7),
              ("<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", 8)]
    events = [e for text, n in deltas for e in turn.feed(TextDelta(text, (0,) * n))]
    events += turn.finish()
    assert [e.call.name for e in events if isinstance(e, ToolCallParsed)] == ["get_weather"]
    assert turn.reasoning_tokens == 4
    # a call that ends the reasoning by itself (no </think>) is not reasoning either
    turn = ParsedTurn(functools.partial(StreamingParser, TOOLS, thinking=True))
    for text, n in [("Weather", 1), (" it is", 2), *deltas[3:]]:
        turn.feed(TextDelta(text, (0,) * n))
    turn.finish()
    assert turn.reasoning_tokens == 3

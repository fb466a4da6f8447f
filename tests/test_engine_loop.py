"""Engine loop with a scripted model double and the real compact tokenizer: streaming,
stop conditions, queueing, cancellation, failures and prefix-cache bookkeeping."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from engine_doubles import ScriptedModel, answer_script

from ling3_rknn.chat.segments import Segment
from ling3_rknn.engine import (
    Admitted,
    ContextLengthExceeded,
    Engine,
    EngineBusy,
    EngineFailure,
    EngineOptions,
    Finished,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    TextDelta,
)
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


def C(text: str) -> Segment:
    return Segment(text, True)


def T(text: str) -> Segment:
    return Segment(text, False)


def prompt(user: str = "say hello", system: str = "be brief") -> list[Segment]:
    return [
        C("<role>SYSTEM</role>"),
        T(system),
        C("<|role_end|><role>HUMAN</role>"),
        T(user),
        C("<|role_end|><role>ASSISTANT</role>"),
    ]


def make_engine(tok, answer_text="hello world", answer_ids=None, **kw
                ) -> tuple[Engine, ScriptedModel]:
    answer = tok.encode_text(answer_text) if answer_ids is None else answer_ids
    close = tok.special_ids["</role>"]
    model = ScriptedModel(
        tok.vocab_size,
        answer_script(answer, close, tok.eos_id),
        eos_token_ids=(tok.special_ids["<|endoftext|>"],),
        delay=kw.pop("delay", 0.0),
    )
    kw.setdefault("checkpoint_min_tokens", 0)
    options = EngineOptions(model_id="test", max_context=kw.pop("max_context", 512), **kw)
    engine = Engine(model, tok, options)
    return engine, model


class EntryGate(threading.Event):
    """``ScriptedModel.gate`` that also says when the worker is waiting on it, so a test
    knows the worker is inside ``forward`` instead of guessing with a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.inside = False  # a thread is blocked in wait() right now

    def wait(self, timeout: float | None = None) -> bool:
        self.inside = True
        self.entered.set()
        try:
            return super().wait(timeout)
        finally:
            self.inside = False


async def until(predicate, timeout: float = 30.0) -> None:
    """Poll ``predicate``; the timeout only guards against a hang, it times nothing."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def collect(engine: Engine, request: GenerationRequest):
    events = [e async for e in engine.generate(request)]
    assert events[0] == Admitted(len(engine.encode_prompt(request.prompt)))
    assert isinstance(events[-1], Finished)
    deltas = [e for e in events[:-1] if isinstance(e, TextDelta)]
    return deltas, events[-1]


async def test_streams_text_and_stops_at_eos(tok):
    engine, _ = make_engine(tok)
    with engine:
        deltas, fin = await collect(engine, GenerationRequest(prompt(), GREEDY))
    text = "".join(d.text for d in deltas)
    assert text == "hello world" == fin.text
    assert fin.finish_reason == "stop"
    assert "<|role_end|>" not in text
    ids = [i for d in deltas for i in d.token_ids]
    assert ids == tok.encode_text("hello world")
    assert fin.usage.prompt_tokens == len(tok.encode_segments(prompt()))
    assert fin.usage.completion_tokens == len(ids) + 1  # + the end-of-turn token
    assert fin.usage.cached_tokens == 0


async def test_model_config_eos_also_stops(tok):
    engine, model = make_engine(tok)
    end = tok.special_ids["<|endoftext|>"]
    model._next = lambda h: end
    with engine:
        deltas, fin = await collect(engine, GenerationRequest(prompt(), GREEDY))
    assert deltas == [] and fin.text == "" and fin.finish_reason == "stop"


async def test_stop_string_never_leaks(tok):
    engine, _ = make_engine(tok, answer_text="hello world and more")
    with engine:
        req = GenerationRequest(prompt(), GREEDY, stop=["o w", "zzz"])
        deltas, fin = await collect(engine, req)
    assert "".join(d.text for d in deltas) == "hell" == fin.text
    assert fin.finish_reason == "stop"


async def test_max_tokens_and_context_limit_give_length(tok):
    engine, _ = make_engine(tok, answer_text="hello world and more")
    with engine:
        _, fin = await collect(engine, GenerationRequest(prompt(), GREEDY, max_tokens=3))
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 3
    n = len(tok.encode_segments(prompt()))
    engine, _ = make_engine(tok, answer_text="hello world and more", max_context=n + 2)
    with engine:
        _, fin = await collect(engine, GenerationRequest(prompt(), GREEDY))
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 2
        # max_tokens beyond the room left is clamped to it (README), however large
        _, fin = await collect(engine, GenerationRequest(prompt(), GREEDY, max_tokens=10**23))
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 2


async def test_typed_errors_before_the_first_event(tok):
    n = len(tok.encode_segments(prompt()))
    engine, model = make_engine(tok, max_context=n)
    with engine:
        with pytest.raises(ContextLengthExceeded) as info:
            await anext(engine.generate(GenerationRequest(prompt(), GREEDY)))
        assert info.value.prompt_tokens == n
        with pytest.raises(InvalidRequest):
            await anext(engine.generate(GenerationRequest(prompt(), SamplingParams(top_p=2.0))))
        with pytest.raises(InvalidRequest):
            await anext(engine.generate(GenerationRequest([], GREEDY)))
        with pytest.raises(InvalidRequest):
            await anext(engine.generate(GenerationRequest(prompt(), GREEDY, max_tokens=0)))
        assert model.calls == []
        assert engine.stats().queue_depth == 0


async def test_queue_is_fifo_and_bounded(tok):
    engine, model = make_engine(tok, max_queue=1)
    model.gate = gate = EntryGate()
    with engine:
        first = engine.generate(GenerationRequest(prompt("one"), GREEDY))
        task1 = asyncio.ensure_future(anext(first))
        assert await asyncio.to_thread(gate.entered.wait, 30)  # worker blocked in forward
        second = engine.generate(GenerationRequest(prompt("two"), GREEDY))
        task2 = asyncio.ensure_future(anext(second))
        await until(lambda: engine.stats().queue_depth == 1)
        with pytest.raises(EngineBusy):
            await anext(engine.generate(GenerationRequest(prompt("three"), GREEDY)))
        model.gate.set()
        await task1
        rest1 = [e async for e in first]
        await task2
        rest2 = [e async for e in second]
        assert isinstance(rest1[-1], Finished) and isinstance(rest2[-1], Finished)
    one = tok.encode_text("one")
    two = tok.encode_text("two")
    flat = [t for c in model.calls for t in c]
    text = repr(flat)
    assert text.index(repr(one)[1:-1]) < text.index(repr(two)[1:-1])


async def test_cancel_stops_within_one_token_and_engine_stays_clean(tok):
    long_answer = " ".join(["hello"] * 40)
    engine, model = make_engine(tok, answer_text=long_answer, delay=0.01)
    with engine:
        stream = engine.generate(GenerationRequest(prompt(), GREEDY))
        assert isinstance(await anext(stream), Admitted)
        assert isinstance(await anext(stream), TextDelta)
        await stream.aclose()  # sets the job's cancel flag before it returns
        calls_at_cancel = len(model.calls)
        await until(lambda: engine.stats().cancelled == 1)
        assert await engine.idle(30)
        assert len(model.calls) <= calls_at_cancel + 1  # at most the forward in progress
        _deltas, fin = await collect(engine, GenerationRequest(prompt("x"), GREEDY))
        assert fin.text == long_answer


async def test_a_request_cancelled_while_queued_counts_as_cancelled(tok):
    """A client that leaves while its request still waits for the worker: the worker drops
    the request without running it, and /metrics' cancelled count includes it."""
    engine, model = make_engine(tok)
    model.gate = gate = EntryGate()
    with engine:
        first = engine.generate(GenerationRequest(prompt("one"), GREEDY))
        task1 = asyncio.ensure_future(anext(first))
        assert await asyncio.to_thread(gate.entered.wait, 30)  # worker blocked in forward
        second = engine.generate(GenerationRequest(prompt("two"), GREEDY))
        assert isinstance(await anext(second), Admitted)  # queued behind the first
        await second.aclose()
        calls = len(model.calls)
        gate.set()
        await task1
        _ = [e async for e in first]
        assert await engine.idle(30)
        assert engine.stats().cancelled == 1
        two = tok.encode_text("two")
        flat = repr([t for c in model.calls[calls:] for t in c])
        assert repr(two)[1:-1] not in flat  # never evaluated


async def test_consumer_task_cancellation_also_cancels(tok):
    engine, model = make_engine(tok, answer_text=" ".join(["hello"] * 40), delay=0.01)
    with engine:

        async def consume():
            async for _ in engine.generate(GenerationRequest(prompt(), GREEDY)):
                pass

        task = asyncio.ensure_future(consume())
        await until(lambda: len(model.calls) >= 3)  # decoding
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.stats().cancelled == 1)
        assert await engine.idle(30)
        n = len(model.calls)
        await asyncio.sleep(0.2)
        assert len(model.calls) == n  # the worker stopped


async def test_model_failure_becomes_engine_failure_and_engine_recovers(tok):
    engine, model = make_engine(tok)
    bad = tok.encode_text("boom")
    model.fail_when = lambda h: any(h[i : i + len(bad)] == bad for i in range(len(h)))
    with engine:
        await collect(engine, GenerationRequest(prompt("ok"), GREEDY))
        await engine.idle()
        cached = engine.stats().cache_entries
        with pytest.raises(EngineFailure):
            async for _ in engine.generate(GenerationRequest(prompt("boom"), GREEDY)):
                pass
        stats = engine.stats()
        assert stats.npu_errors == 1 and stats.cache_entries == cached
        _, fin = await collect(engine, GenerationRequest(prompt("ok"), GREEDY))
        assert fin.text == "hello world" and fin.usage.cached_tokens > 0


async def test_nan_logits_fail_the_request_only(tok):
    engine, model = make_engine(tok)
    model.nan_when = lambda h: h[-1] == tok.encode_text("hello")[0]
    with engine:
        with pytest.raises(EngineFailure):
            async for _ in engine.generate(GenerationRequest(prompt(), GREEDY)):
                pass
        model.nan_when = None
        _, fin = await collect(engine, GenerationRequest(prompt("other"), GREEDY))
        assert fin.text == "hello world"


async def test_event_loop_stays_responsive_while_the_model_computes(tok):
    """forward runs off the event loop: while it is blocked, the loop still runs other
    coroutines (checked by order of events, not by timing, so CPU load cannot fail it)."""
    engine, model = make_engine(tok, answer_text=" ".join(["hello"] * 10))
    model.gate = gate = EntryGate()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    with engine:
        job = asyncio.ensure_future(collect(engine, GenerationRequest(prompt(), GREEDY)))
        assert await asyncio.to_thread(gate.entered.wait, 30)
        t = asyncio.ensure_future(ticker())
        await until(lambda: ticks >= 100)
        assert gate.inside  # ... all while the worker was blocked inside forward
        gate.set()
        _, fin = await job
        t.cancel()
    assert fin.text == " ".join(["hello"] * 10)


async def test_same_prompt_twice_evaluates_nothing_the_second_time(tok):
    engine, model = make_engine(tok)
    with engine:
        _, fin1 = await collect(engine, GenerationRequest(prompt(), GREEDY))
        await engine.idle()
        before = model.evaluated
        _, fin2 = await collect(engine, GenerationRequest(prompt(), GREEDY))
        await engine.idle()
    n = fin1.usage.prompt_tokens
    assert fin2.usage.cached_tokens == n
    assert fin2.text == fin1.text
    # Only decode steps ran: one per generated token except the last (eos), plus the
    # end-of-turn evaluation for the cache.
    assert model.evaluated - before == fin2.usage.completion_tokens


async def test_next_turn_reuses_generated_ids_and_evaluates_only_new_tokens(tok):
    engine, model = make_engine(tok)
    with engine:
        _, fin1 = await collect(engine, GenerationRequest(prompt(), GREEDY))
        turn2 = [
            *prompt(),
            T(fin1.text),
            C("<|role_end|><role>HUMAN</role>"),
            T("thanks"),
            C("<|role_end|><role>ASSISTANT</role>"),
        ]
        await engine.idle()
        before_calls = len(model.calls)
        prefilled_before = engine.stats().prefill_tokens
        _, fin2 = await collect(engine, GenerationRequest(turn2, GREEDY))
        stats = engine.stats()
    new_tokens = tok.encode_segments(
        [C("<role>HUMAN</role>"), T("thanks"), C("<|role_end|><role>ASSISTANT</role>")]
    )
    assert fin2.usage.cached_tokens == fin2.usage.prompt_tokens - len(new_tokens)
    assert stats.prefill_tokens - prefilled_before == len(new_tokens)
    fed = [t for call in model.calls[before_calls:] for t in call]
    assert fed[: len(new_tokens)] == new_tokens
    assert stats.cache_hits == 1 and stats.cache_tokens_reused == fin2.usage.cached_tokens


async def test_changed_system_prompt_misses(tok):
    engine, _ = make_engine(tok)
    with engine:
        await collect(engine, GenerationRequest(prompt(system="be brief"), GREEDY))
        _, fin = await collect(engine, GenerationRequest(prompt(system="be long"), GREEDY))
    assert fin.usage.cached_tokens == 0


async def test_edited_last_message_falls_back_to_the_header_snapshot(tok):
    engine, _ = make_engine(tok)
    with engine:
        await collect(engine, GenerationRequest(prompt(user="say hello"), GREEDY))
        _, fin = await collect(engine, GenerationRequest(prompt(user="say goodbye"), GREEDY))
    header = tok.encode_segments([C("<role>SYSTEM</role>"), T("be brief"), C("<|role_end|>")])
    assert fin.usage.cached_tokens == len(header)


async def test_persistent_cache_survives_a_restart(tok, tmp_path):
    kw = {"cache_dir": tmp_path}  # read back by ScriptedModel.snapshot_from_arrays
    engine, _ = make_engine(tok, **kw)
    with engine:
        _, fin1 = await collect(engine, GenerationRequest(prompt(), GREEDY))
    assert list(tmp_path.glob("*.l3snap"))
    engine, _model = make_engine(tok, **kw)
    with engine:
        assert engine.stats().cache_bytes == 0  # lazily indexed, nothing loaded yet
        _, fin2 = await collect(engine, GenerationRequest(prompt(), GREEDY))
    assert fin2.usage.cached_tokens == fin1.usage.prompt_tokens
    assert fin2.text == fin1.text


async def test_seeded_sampling_is_reproducible(tok):
    engine, model = make_engine(tok)
    model._next = lambda h: (len(h) * 7) % 50 + 20  # never eos
    sampling = SamplingParams(temperature=5.0, top_k=0, top_p=1.0, seed=42)
    with engine:
        _, a = await collect(engine, GenerationRequest(prompt(), sampling, max_tokens=12))
        _, b = await collect(engine, GenerationRequest(prompt(), sampling, max_tokens=12))
        other = SamplingParams(temperature=5.0, top_k=0, top_p=1.0, seed=7)
        _, c = await collect(engine, GenerationRequest(prompt(), other, max_tokens=12))
    assert a.text == b.text and a.text != c.text


def test_close_is_idempotent_and_refuses_new_work(tok):
    engine, _ = make_engine(tok)
    engine.close()
    engine.close()
    assert not engine.ready

    async def go():
        with pytest.raises(EngineFailure):
            await anext(engine.generate(GenerationRequest(prompt(), GREEDY)))

    asyncio.run(go())


def long_prompt(first: str, last: str) -> list[Segment]:
    return [
        C("<role>SYSTEM</role>"),
        T("be brief"),
        C("<|role_end|><role>HUMAN</role>"),
        T(first),
        C("<|role_end|><role>ASSISTANT</role>"),
        T("sure"),
        C("<|role_end|><role>HUMAN</role>"),
        T(last),
        C("<|role_end|><role>ASSISTANT</role>"),
    ]


async def test_boundary_snapshots_cover_header_and_last_message(tok):
    engine, _ = make_engine(tok)
    base = long_prompt("first question", "last question")
    ids = tok.encode_segments(base)
    ends = [i + 1 for i, t in enumerate(ids) if t == tok.eos_id]
    with engine:
        await collect(engine, GenerationRequest(base, GREEDY))
        _, edited_last = await collect(
            engine, GenerationRequest(long_prompt("first question", "other"), GREEDY)
        )
        _, edited_first = await collect(
            engine, GenerationRequest(long_prompt("other", "last question"), GREEDY)
        )
    assert edited_last.usage.cached_tokens == ends[2]  # start of the last user message
    assert edited_first.usage.cached_tokens == ends[0]  # end of the system header


async def test_close_during_a_stream_fails_it_instead_of_hanging(tok):
    engine, _ = make_engine(tok, answer_text=" ".join(["hello"] * 40), delay=0.02)
    stream = engine.generate(GenerationRequest(prompt(), GREEDY))
    assert isinstance(await anext(stream), Admitted)
    assert isinstance(await anext(stream), TextDelta)
    await asyncio.to_thread(engine.close)

    async def drain():
        async for _ in stream:
            pass

    with pytest.raises(EngineFailure):
        await asyncio.wait_for(drain(), 30)  # hang guard only


async def test_thinking_turn_round_trips_through_the_chat_layer(tok):
    """Reasoning + content + a tool call, parsed and re-rendered by the real chat layer,
    splice back onto the generated ids: turn 2 evaluates only the tool result turn."""
    from ling3_rknn.chat import assistant_message, parse_assistant, render

    tools = [{"type": "function", "function": {
        "name": "read", "parameters": {"type": "object",
                                       "properties": {"path": {"type": "string"}}}}}]
    answer = [
        *tok.encode_text("look"), tok.special_ids["</think>"], *tok.encode_text("ok"),
        *tok.encode_segments([C("\n<tool_call>")]), *tok.encode_text("read\n"),
        tok.special_ids["<arg_key>"], *tok.encode_text("path"), tok.special_ids["</arg_key>"],
        *tok.encode_text("\n"), tok.special_ids["<arg_value>"], *tok.encode_text("a.py"),
        tok.special_ids["</arg_value>"], *tok.encode_text("\n"), tok.special_ids["</tool_call>"],
    ]
    think = tok.special_ids["<think>"]  # the generation prompt ends with it
    model = ScriptedModel(tok.vocab_size, answer_script(answer, think, tok.eos_id))
    history = [{"role": "user", "content": "read a.py"}]
    options = EngineOptions(model_id="t", max_context=1024, checkpoint_min_tokens=0)
    with Engine(model, tok, options) as engine:
        _, fin = await collect(engine, GenerationRequest(render(history, tools), GREEDY))
        parsed = parse_assistant(fin.text, tools, thinking=True)
        assert parsed.reasoning == "look" and parsed.tool_calls
        history.append(assistant_message(parsed, ["call_1"]))
        history.append({"role": "tool", "tool_call_id": "call_1", "content": "x = 1"})
        await engine.idle()
        turn2 = render(history, tools)
        _, fin2 = await collect(engine, GenerationRequest(turn2, GREEDY))
    prompt1 = tok.encode_segments(render(history[:1], tools))
    assert fin2.usage.cached_tokens == len(prompt1) + len(answer) + 1  # + <|role_end|>
    tail = tok.encode_segments(
        [C("<role>OBSERVATION</role>\n<tool_response>\n"), T("x = 1"),
         C("\n</tool_response><|role_end|><role>ASSISTANT</role>\n<think>")]
    )
    assert fin2.usage.prompt_tokens - fin2.usage.cached_tokens == len(tail)


async def test_special_tokens_outside_the_answer_grammar_end_the_turn(tok):
    """A model that writes a role header or a made-up tool result is past its own turn:
    generation stops there and the token is never text (issue 12, item 5)."""
    for name in ("<tool_response>", "<role>", "<|endoftext|>"):
        answer = [*tok.encode_text("it is"), tok.special_ids[name], *tok.encode_text(" more")]
        engine, _ = make_engine(tok, answer_ids=answer)
        with engine:
            deltas, fin = await collect(engine, GenerationRequest(prompt(), GREEDY))
        assert fin.text == "it is" == "".join(d.text for d in deltas), name
        assert fin.finish_reason == "stop"


async def test_answer_markup_tokens_pass_and_generation_config_eos_stops(tok):
    think = [tok.special_ids["<think>"], *tok.encode_text("hm"), tok.special_ids["</think>"]]
    stop_word = tok.encode_text(" STOP")
    answer = [*think, *tok.encode_text("ok"), *stop_word, *tok.encode_text(" more")]
    engine, _ = make_engine(tok, answer_ids=answer, eos_token_ids=[stop_word[0]])
    with engine:
        _, fin = await collect(engine, GenerationRequest(prompt(), GREEDY))
    assert fin.text == "<think>hm</think>ok"
    assert fin.finish_reason == "stop"

"""The engine on a model whose prefill attention runs on the NPU (the numpy double of the
matmul interface; small pieces so a short prompt spans several): an agent's second turn
still evaluates only its new tokens and keeps the NPU rows of the first, a long prompt is
fed two pieces per call (pipelined), and a cancelled prefill stops within that call."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from engine_doubles import DelegatingModel
from engine_tiny_model import make_tiny_checkpoint
from npu_matmul_double import DoubleRuntime

from ling3_rknn.chat import render
from ling3_rknn.engine import (
    Engine,
    EngineOptions,
    Finished,
    GenerationRequest,
    SamplingParams,
)
from ling3_rknn.model import Model
from ling3_rknn.model.mla_npu import NpuAttention, NpuAttentionShapes, NpuRows
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
GREEDY = SamplingParams(temperature=0.0)


class GatedSpy(DelegatingModel):
    """Records each forward's length; once ``hold`` is set, the next forward waits on
    ``release`` after signalling ``entered``."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.calls: list[int] = []
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, token_ids, state, *, last_only: bool = False):
        self.calls.append(len(token_ids))
        if self.hold:
            self.hold = False
            self.entered.set()
            self.release.wait(30)
        return super().forward(token_ids, state, last_only=last_only)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


@pytest.fixture(scope="module")
def npu_model(tmp_path_factory) -> Model:
    base = Model.from_hf(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    c = base.config
    shapes = NpuAttentionShapes.of(c, query_rows=32, piece_rows=64)
    return Model(c, base.stages, base.experts, base.cpu, threads=2,
                 npu_attention=NpuAttention(DoubleRuntime(), shapes))


def _engine(model, tok) -> Engine:
    return Engine(model, tok, EngineOptions(model_id="tiny", max_context=4096,
                                            prefill_chunk=model._model.prefill_chunk,
                                            checkpoint_min_tokens=8))


def _messages(words: int, question: str) -> list[dict]:
    return [{"role": "system", "content": " ".join(f"rule{i}" for i in range(words))},
            {"role": "user", "content": question}]


async def _run(engine: Engine, segments, max_tokens: int = 3) -> Finished:
    events = [e async for e in engine.generate(
        GenerationRequest(segments, GREEDY, max_tokens=max_tokens))]
    await engine.idle()
    assert isinstance(events[-1], Finished)
    return events[-1]


async def test_a_long_prompt_is_fed_in_pipelined_pairs_and_reused(npu_model, tok):
    spy = GatedSpy(npu_model)
    assert npu_model.prefill_chunk == 2 * npu_model.pipeline_piece == 64
    with _engine(spy, tok) as engine:
        first = render(_messages(120, "hello"), None, enable_thinking=False)
        fin1 = await _run(engine, first)
        assert max(spy.calls) == 64  # two 32-token pieces per call
        before = len(spy.calls)
        second = render(_messages(120, "hello again"), None, enable_thinking=False)
        fin2 = await _run(engine, second)
    # the system prompt's snapshot served the second request: only its new tail ran
    assert fin2.usage.cached_tokens > 0
    assert sum(spy.calls[before:]) < fin2.usage.prompt_tokens
    assert fin1.usage.prompt_tokens > 64


async def test_a_cancelled_prefill_stops_within_one_call(npu_model, tok):
    spy = GatedSpy(npu_model)
    with _engine(spy, tok) as engine:
        spy.hold = True
        stream = engine.generate(GenerationRequest(
            render(_messages(400, "count"), None, enable_thinking=False), GREEDY,
            max_tokens=2))
        task = asyncio.ensure_future(anext(stream))
        await task  # Admitted
        assert await asyncio.to_thread(spy.entered.wait, 30)
        calls_at_cancel = len(spy.calls)
        await stream.aclose()
        spy.release.set()
        assert await engine.idle(30)
        assert len(spy.calls) <= calls_at_cancel  # the call in progress was the last
        assert engine.stats().cancelled == 1
        fin = await _run(engine, render(_messages(10, "hi"), None, enable_thinking=False))
        assert fin.usage.prompt_tokens > 0


def test_the_rows_stay_on_the_npu_through_the_engine(npu_model):
    state = npu_model.new_state()
    rng = np.random.default_rng(0)
    npu_model.forward(rng.integers(2, 1000, 100), state)
    rows = state.prefill_scratch.rows
    assert rows and all(isinstance(r, NpuRows) for r in rows.values())
    assert all(r.length == 100 for r in rows.values())

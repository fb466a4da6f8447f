"""Agent loop on the real numpy model (tiny random checkpoint), the real compact tokenizer
and the real chat renderer/parser: the prefix cache must make turn 2 evaluate only its new
tokens, and the logits it continues from must equal a cold evaluation of the whole prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_doubles import DelegatingModel
from engine_tiny_model import make_tiny_checkpoint
from fp_bounds import model_error
from safetensors import safe_open

from ling3_rknn.chat import assistant_message, parse_assistant, render
from ling3_rknn.engine import (
    Engine,
    EngineOptions,
    Finished,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)
from ling3_rknn.engine.cache.snapshot_store import model_fingerprint
from ling3_rknn.model import Model, native
from ling3_rknn.model.mla_expanded import ExpandedRows
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
GREEDY = SamplingParams(temperature=0.0)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a coding agent."}


class SpyModel(DelegatingModel):
    """Delegates to the real model; records what was evaluated and the last logits row."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.fed: list[int] = []
        self.last_rows: list[np.ndarray] = []

    def forward(self, token_ids, state, *, last_only: bool = False):
        out = super().forward(token_ids, state, last_only=last_only)
        self.fed.extend(int(t) for t in token_ids)
        self.last_rows.append(out[-1].copy())
        return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    return Model.from_hf(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def cold_logits(model: Model, ids: list[int]) -> np.ndarray:
    return model.forward(ids, model.new_state(), last_only=True)[-1]


def same_logits(model: Model, ids: list[int], row: np.ndarray, cold: np.ndarray) -> bool:
    """A cached prefix continued, against one cold call: two float32 evaluations of the
    model in other piece splits (tests/fp_bounds.py ``model_error``)."""
    tol = model_error(model.config, len(ids), float(np.abs(cold).max()))
    return bool(np.abs(row - cold).max() <= tol)


async def run(engine: Engine, segments, max_tokens: int) -> tuple[Finished, list[int]]:
    events = [
        e
        async for e in engine.generate(
            GenerationRequest(segments, GREEDY, max_tokens=max_tokens)
        )
    ]
    await engine.idle()
    ids = [i for e in events if isinstance(e, TextDelta) for i in e.token_ids]
    assert isinstance(events[-1], Finished)
    return events[-1], ids


def engine_for(spy, tok, **kw) -> Engine:
    kw.setdefault("checkpoint_min_tokens", 8)
    return Engine(spy, tok, EngineOptions(model_id="tiny", max_context=2048, **kw))


async def turn_one(engine: Engine, tok: Tokenizer, user: str = "Open a.py"):
    history = [SYSTEM, {"role": "user", "content": user}]
    fin, gen_ids = await run(engine, render(history, TOOLS, enable_thinking=False), 6)
    parsed = parse_assistant(fin.text, TOOLS, thinking=False)
    history.append(assistant_message(parsed))
    return history, fin, gen_ids


def with_tool_result(history: list[dict]) -> list[dict]:
    return [*history, {"role": "tool", "tool_call_id": "c1", "content": "print(1)\n"}]


async def test_turn_two_evaluates_exactly_its_new_tokens(model, tok):
    spy = SpyModel(model)
    with engine_for(spy, tok) as engine:
        history, _fin1, gen_ids = await turn_one(engine, tok)
        prompt1 = tok.encode_segments(render(history[:2], TOOLS, enable_thinking=False))
        turn2 = render(with_tool_result(history), TOOLS, enable_thinking=False)
        ids2 = engine.encode_prompt(turn2)
        # The history carries the generated ids, then only the new turn is encoded.
        spliced = [*prompt1, *gen_ids, tok.eos_id]
        assert ids2[: len(spliced)] == spliced
        new_tokens = ids2[len(spliced) :]
        assert tok.decode(new_tokens).startswith("<role>OBSERVATION</role>")

        fed_before = len(spy.fed)
        rows_before = len(spy.last_rows)
        stats_before = engine.stats()
        fin2, _ = await run(engine, turn2, 3)
        stats = engine.stats()

    assert fin2.usage.prompt_tokens == len(ids2)
    assert fin2.usage.cached_tokens == len(spliced)
    assert stats.prefill_tokens - stats_before.prefill_tokens == len(new_tokens)
    assert spy.fed[fed_before : fed_before + len(new_tokens)] == new_tokens  # none of turn 1
    # The prefill's last row is what the first token of turn 2 was sampled from.
    prefill_calls = -(-len(new_tokens) // 64) + 1  # chunks + the boundary split
    rows = spy.last_rows[rows_before : rows_before + prefill_calls + 1]
    cold = cold_logits(model, ids2)
    assert any(same_logits(model, ids2, r, cold) for r in rows)
    assert stats.cache_hits - stats_before.cache_hits == 1


@pytest.mark.skipif(not native.available(), reason="the expanded form needs the kernels")
async def test_turn_two_keeps_the_rows_projected_in_turn_one(model, tok, monkeypatch):
    """Turn 2 resumes from the live state's own end-of-turn snapshot, which keeps the MLA
    rows projected for the expanded prefill form: it projects the rows of what it evaluates,
    never turn 1's prompt again."""
    projected: list[int] = []
    extend = ExpandedRows.extend
    monkeypatch.setattr(ExpandedRows, "extend",
                        lambda rows, latent: (projected.append(len(latent)), extend(rows, latent)))
    with engine_for(SpyModel(model), tok) as engine:
        history, _, gen_ids = await turn_one(engine, tok)
        prompt1 = tok.encode_segments(render(history[:2], TOOLS, enable_thinking=False))
        layers = len(model.config.mla_layers)
        assert sum(projected) >= len(prompt1) * layers  # turn 1 ran the expanded form
        projected.clear()
        turn2 = render(with_tool_result(history), TOOLS, enable_thinking=False)
        ids2 = engine.encode_prompt(turn2)
        fin2, _ = await run(engine, turn2, 3)
    cached = fin2.usage.cached_tokens
    assert cached == len(prompt1) + len(gen_ids) + 1
    assert projected and max(projected) < len(prompt1)
    # the rows of the tokens turn 2 evaluated, no more: its new prompt tokens, and those of
    # its answer when the end-of-turn feed runs the expanded form
    assert sum(projected) >= (len(ids2) - cached) * layers
    assert sum(projected) <= (len(ids2) - cached + fin2.usage.completion_tokens + 1) * layers


async def test_first_token_logits_equal_cold_evaluation_when_fully_cached(model, tok):
    spy = SpyModel(model)
    with engine_for(spy, tok) as engine:
        segments = render([SYSTEM, {"role": "user", "content": "hi"}], TOOLS,
                          enable_thinking=False)
        fin1, ids1 = await run(engine, segments, 4)
        fed = len(spy.fed)
        fin2, ids2 = await run(engine, segments, 4)
    assert fin2.usage.cached_tokens == fin2.usage.prompt_tokens
    assert ids2 == ids1 and fin2.text == fin1.text  # greedy after restore == after prefill
    # Nothing of the prompt was evaluated again: only the decode steps.
    assert len(spy.fed) - fed == len(ids2) + 1  # 3 decode feeds + [last, eos] at the end


async def test_next_session_with_a_short_question_reuses_the_header(model, tok):
    """An agent's next session: the same system prompt and tools, another short question
    (closer to the end than the snapshot gap). Only the question is evaluated."""
    with engine_for(SpyModel(model), tok) as engine:
        first = render([SYSTEM, {"role": "user", "content": "Open a.py"}], TOOLS,
                       enable_thinking=False)
        await run(engine, first, 2)
        second = render([SYSTEM, {"role": "user", "content": "Fix b.py"}], TOOLS,
                        enable_thinking=False)
        ids = engine.encode_prompt(second)
        fin, _ = await run(engine, second, 2)
    header = tok.encode_segments(render([SYSTEM], TOOLS, enable_thinking=False,
                                        add_generation_prompt=False))
    assert ids[: len(header)] == header and len(ids) - len(header) < 64
    assert fin.usage.cached_tokens == len(header)


async def test_changed_system_prompt_misses(model, tok):
    spy = SpyModel(model)
    with engine_for(spy, tok) as engine:
        await turn_one(engine, tok)
        other = render(
            [{"role": "system", "content": "You are a poet."},
             {"role": "user", "content": "Open a.py"}],
            TOOLS,
            enable_thinking=False,
        )
        fin, _ = await run(engine, other, 2)
    assert fin.usage.cached_tokens == 0


async def test_edited_earlier_message_falls_back_to_deepest_valid_snapshot(model, tok):
    spy = SpyModel(model)
    with engine_for(spy, tok) as engine:
        history, _, _ = await turn_one(engine, tok)
        edited = with_tool_result([history[0], {"role": "user", "content": "Open b.py"},
                                   *history[2:]])
        segments = render(edited, TOOLS, enable_thinking=False)
        ids = engine.encode_prompt(segments)
        header = tok.encode_segments(render([SYSTEM], TOOLS, enable_thinking=False,
                                            add_generation_prompt=False))
        rows_before = len(spy.last_rows)
        fin, _ = await run(engine, segments, 2)
    assert ids[: len(header)] == header
    assert fin.usage.cached_tokens == len(header)  # the system + tools header snapshot
    cold = cold_logits(model, ids)
    assert any(
        same_logits(model, ids, r, cold) for r in spy.last_rows[rows_before:]
    )


async def test_persisted_prefix_is_reused_after_restart_and_foreign_files_are_dropped(
    model, tok, tmp_path
):
    spy = SpyModel(model)
    with engine_for(spy, tok, cache_dir=tmp_path, weights_identity="bundle-1") as engine:
        history, _fin1, gen_ids = await turn_one(engine, tok)
    files = sorted(tmp_path.glob("*.l3snap"))
    assert files

    spy2 = SpyModel(model)
    turn2 = render(with_tool_result(history), TOOLS, enable_thinking=False)
    with engine_for(spy2, tok, cache_dir=tmp_path, weights_identity="bundle-1") as engine:
        assert engine.stats().cache_entries == len(files)
        ids2 = engine.encode_prompt(turn2)
        fin2, _ = await run(engine, turn2, 2)
    # The transcript persisted with the end-of-turn snapshot still splices the generated
    # ids after the restart, so turn 2 again evaluates only its new tokens.
    prompt1 = tok.encode_segments(render(history[:2], TOOLS, enable_thinking=False))
    spliced = [*prompt1, *gen_ids, tok.eos_id]
    assert ids2[: len(spliced)] == spliced
    assert fin2.usage.cached_tokens == len(spliced)
    cold = cold_logits(model, ids2)
    assert any(same_logits(model, ids2, r, cold) for r in spy2.last_rows)

    with engine_for(SpyModel(model), tok, cache_dir=tmp_path, weights_identity="bundle-2") as e:
        assert e.stats().cache_entries == 0
        fin3, _ = await run(e, turn2, 1)
    assert fin3.usage.cached_tokens == 0
    owners = set()
    for f in tmp_path.glob("*.l3snap"):
        with safe_open(str(f), framework="numpy") as handle:
            owners.add(handle.metadata()["fingerprint"])
    assert owners == {model_fingerprint(model.config, "bundle-2")}


async def test_same_config_different_weights_never_share_persisted_snapshots(
    model, tok, tmp_path_factory
):
    """No weights identity given: the engine's probe digest still tells the models apart."""
    cache = tmp_path_factory.mktemp("cache")
    other = Model.from_hf(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny2"), seed=1))
    segments = render([SYSTEM, {"role": "user", "content": "hi"}], TOOLS, enable_thinking=False)
    with engine_for(SpyModel(model), tok, cache_dir=cache) as engine:
        await run(engine, segments, 2)
    assert list(cache.glob("*.l3snap"))
    with engine_for(SpyModel(model), tok, cache_dir=cache) as engine:
        fin, _ = await run(engine, segments, 2)
    assert fin.usage.cached_tokens == fin.usage.prompt_tokens  # same weights: reused
    with engine_for(SpyModel(other), tok, cache_dir=cache) as engine:
        assert engine.stats().cache_entries == 0
        fin, _ = await run(engine, segments, 2)
    assert fin.usage.cached_tokens == 0


def test_cache_charges_the_real_models_shared_latent_once(model):
    from ling3_rknn.engine.cache.prefix_cache import PrefixCache
    from ling3_rknn.model.state import BLOCK_TOKENS

    state = model.new_state()
    ids = [(7 * i) % 800 + 14 for i in range(BLOCK_TOKENS + 5)]
    first = model.forward(ids, state, last_only=True)[-1]
    a = state.snapshot()
    second = model.forward([20, 21], state, last_only=True)[-1]
    b = state.snapshot()
    shared = {id(x): x.nbytes for x in (*a.shared_blocks(), *b.shared_blocks())}
    assert shared  # the first block is frozen and shared by both snapshots
    cache = PrefixCache(10**9)
    cache.insert(ids, a, first)
    cache.insert([*ids, 20, 21], b, second)
    rows = first.nbytes + second.nbytes
    want = a.private_nbytes + b.private_nbytes + sum(shared.values()) + rows
    assert cache.counters().bytes_held == want < a.nbytes + b.nbytes + rows

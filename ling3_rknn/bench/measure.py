"""Drive a real engine through its public async API and collect the figures.

The engine is built exactly as ``ling3-rknn serve`` builds it (``loading`` /
``demo.load_demo_engine``) and fed real ``GenerationRequest``s; prefill and decode speeds
come from the engine's own counters (the ones ``/metrics`` exports), so the bench measures
the product, not a loop of its own.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ling3_rknn.bundle import Bundle
from ling3_rknn.chat import (
    Admitted,
    Finished,
    StreamingParser,
    assistant_message,
    parse_assistant,
    render,
)
from ling3_rknn.engine import Engine, GenerationRequest, SamplingParams
from ling3_rknn.model.bundle_executors import open_stage

from . import npu_matmul, prompts
from .progress import Progress
from .timers import ComponentTimers, Split

FULL_SIZES = (128, 466, 2048, 8192, 16384, 32768)
QUICK_SIZES = (128, 466)
QUICK_AGENT_TOKENS = 3065  # pi's first request; opencode's shape at pi's size
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    decode_tokens: int
    empty_graph_calls: int
    agent_request_tokens: int
    matmul_runs: int = 20


def make_plan(quick: bool) -> Plan:
    if quick:
        return Plan(QUICK_SIZES, decode_tokens=32, empty_graph_calls=20,
                    agent_request_tokens=QUICK_AGENT_TOKENS, matmul_runs=5)
    return Plan(FULL_SIZES, decode_tokens=64, empty_graph_calls=100,
                agent_request_tokens=prompts.OPENCODE_FIRST_REQUEST_TOKENS)


def capped_sizes(sizes: Sequence[int], max_context: int, decode_tokens: int) -> list[int]:
    """Prompt sizes that leave room to decode; a size past the context becomes its cap."""
    cap = max_context - decode_tokens - 2
    return sorted({min(s, cap) for s in sizes if min(s, cap) > 0})


def model_of(engine: Engine) -> Any:
    """The model the engine's worker runs: the very object (to time its stages and experts
    in place), not a second copy."""
    return engine.model


async def _generate(engine: Engine, request: GenerationRequest) -> tuple[Finished, float]:
    """Run ``request`` to the end; (its Finished event, seconds to the first token)."""
    t0 = time.perf_counter()
    first: float | None = None
    finished: Finished | None = None
    async for event in engine.generate(request):
        if first is None and not isinstance(event, Admitted):  # text, a call or the end
            first = time.perf_counter() - t0
        if isinstance(event, Finished):
            finished = event
    await engine.idle()  # the end-of-turn snapshot happens after Finished
    if finished is None:
        raise RuntimeError("the engine ended a generation without a Finished event")
    return finished, first if first is not None else time.perf_counter() - t0


async def sized_run(engine: Engine, timers: ComponentTimers, size: int, decode_tokens: int
                    ) -> dict[str, Any]:
    """Prefill a fresh ``size``-token prompt, decode up to ``decode_tokens`` after it."""
    segments, tokens = prompts.sized_prompt(_counter(engine), size, f"{size}-{time.time()}")
    before = engine.stats()
    timers.reset()
    fin, ttft = await _generate(
        engine, GenerationRequest(segments, GREEDY, max_tokens=decode_tokens))
    after = engine.stats()
    prefill_tokens = after.prefill_tokens - before.prefill_tokens
    prefill_s = after.prefill_seconds - before.prefill_seconds
    decoded = after.decode_tokens - before.decode_tokens
    decode_s = after.decode_seconds - before.decode_seconds
    split = timers.decode.per_token_ms()
    if decoded and decode_s > 0:
        split["engine"] = max(0.0, 1e3 * decode_s / decoded - split.get("forward", 0.0))
    return {
        "target": size, "prompt_tokens": tokens, "cached_tokens": fin.usage.cached_tokens,
        "prefill_tokens": prefill_tokens, "prefill_s": prefill_s,
        "prefill_tok_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
        "ttft_s": ttft, "completion_tokens": fin.usage.completion_tokens,
        "decode_tokens": decoded, "decode_s": decode_s,
        "decode_tok_s": decoded / decode_s if decoded and decode_s > 0 else None,
        "finish_reason": fin.finish_reason, "ms_per_token": split,
        "prefill_ms_per_token": timers.prefill.per_token_ms(),
        "npu_calls_per_token": _per_token(timers.decode),
        "npu_calls_per_prefill_token": _per_token(timers.prefill),
    }


def _counter(engine: Engine) -> Callable[[Sequence[Any]], int]:
    """Tokens the engine would evaluate for a prompt (its own encoder, splices included)."""
    return lambda segments: len(engine.encode_prompt(segments))


def _per_token(split: Split) -> float | None:
    return split.graph_calls / split.tokens if split.tokens else None


async def agent_loop(engine: Engine) -> dict[str, Any]:
    """Two turns of a tool loop as a client sends them (thinking on, the server default):
    turn 2 should evaluate only what is new after turn 1's prompt and answer."""
    tools = prompts.WEATHER_TOOLS
    parser = functools.partial(StreamingParser, tools, thinking=True)
    history = prompts.agent_turn_one()
    fin1, ttft1 = await _generate(engine, GenerationRequest(
        render(history, tools), parser=parser, max_tokens=64))
    reply = assistant_message(parse_assistant(fin1.text, tools, thinking=True))
    before = engine.stats()
    fin2, ttft2 = await _generate(engine, GenerationRequest(
        render(prompts.agent_turn_two(history, reply), tools), parser=parser, max_tokens=32))
    after = engine.stats()
    turn2 = fin2.usage
    return {
        "turn1_prompt_tokens": fin1.usage.prompt_tokens,
        "turn1_completion_tokens": fin1.usage.completion_tokens,
        "turn1_tool_calls": len(reply.get("tool_calls") or []),
        "turn1_ttft_s": ttft1,
        "turn2_prompt_tokens": turn2.prompt_tokens,
        "turn2_cached_tokens": turn2.cached_tokens,
        "turn2_evaluated_tokens": after.prefill_tokens - before.prefill_tokens,
        "turn2_hit_ratio": turn2.cached_tokens / turn2.prompt_tokens,
        "turn2_ttft_s": ttft2,
    }


async def agent_first_request(engine: Engine, target: int) -> dict[str, Any]:
    """Time to first token of an agent's first request (``prompts.agent_first_request``:
    opencode's shape and, in a full run, its size) on a cold cache, then of the same agent's
    next session (same system prompt and tools, another question): what a user waits for
    before the first word, and what every later session of that agent costs."""
    count = _counter(engine)
    limit = min(target, engine.max_context - 8)
    segments, tokens, next_session = prompts.agent_first_request(count, limit,
                                                                 f"agent-{time.time()}")
    before = engine.stats()
    _, ttft = await _generate(engine, GenerationRequest(segments, GREEDY, max_tokens=1))
    middle = engine.stats()
    second, ttft2 = await _generate(engine, GenerationRequest(
        next_session("Now add a test for the empty input case."), GREEDY, max_tokens=1))
    after = engine.stats()
    evaluated = middle.prefill_tokens - before.prefill_tokens
    seconds = middle.prefill_seconds - before.prefill_seconds
    return {
        "prompt_tokens": tokens, "ttft_s": ttft,
        "prefill_tok_s": evaluated / seconds if seconds > 0 else None,
        "next_session_prompt_tokens": second.usage.prompt_tokens,
        "next_session_cached_tokens": second.usage.cached_tokens,
        "next_session_evaluated_tokens": after.prefill_tokens - middle.prefill_tokens,
        "next_session_ttft_s": ttft2,
    }


def empty_graph_latency(bundle: Bundle, calls: int) -> dict[str, Any]:
    """Per-call latency of the smallest stage graph at its decode shape, on its own
    executor (opened the way the model opens it): the fixed cost every NPU call pays.
    Bundles carry no empty graph, so the smallest stage stands in for one."""
    name = min(bundle.manifest.stages, key=lambda n: (bundle.manifest.stages[n].nbytes, n))
    spec = bundle.manifest.stages[name]
    shapes = min(spec.shape_sets, key=lambda group: sum(int(np.prod(s)) for s in group))
    feeds = [np.zeros(shape, np.float32) for shape in shapes]
    executor = open_stage(bundle, name)
    try:
        for _ in range(3):  # first runs allocate; not timed
            executor.run(*feeds)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            executor.run(*feeds)
            times.append(time.perf_counter() - t0)
    finally:
        executor.close()
    return {"stage": name, "nbytes": spec.nbytes, "shapes": [list(s) for s in shapes],
            "calls": calls, "median_us": 1e6 * statistics.median(times),
            "min_us": 1e6 * min(times)}


async def _measure_engine(engine: Engine, plan: Plan, progress: Progress) -> dict[str, Any]:
    timers = ComponentTimers()
    timers.install(model_of(engine))
    progress.step("warm-up (first run of every graph)")
    warm, _ = prompts.sized_prompt(_counter(engine), 80, f"warm-{time.time()}")
    await _generate(engine, GenerationRequest(warm, GREEDY, max_tokens=2))
    runs = []
    for size in capped_sizes(plan.sizes, engine.max_context, plan.decode_tokens):
        progress.step(f"prefill {size} tokens + decode {plan.decode_tokens}")
        runs.append(await sized_run(engine, timers, size, plan.decode_tokens))
    progress.step("agent loop, 2 turns")
    loop = await agent_loop(engine)
    progress.step(f"agent first request ({plan.agent_request_tokens} tokens) + next session")
    agent = await agent_first_request(engine, plan.agent_request_tokens)
    return {"runs": runs, "prefix_cache": loop, "agent_first_request": agent}


def measure(engine: Engine, bundle: Bundle, plan: Plan, progress: Progress
            ) -> dict[str, Any]:
    """Every figure of one bench run on an engine built from ``bundle``."""
    progress.step("empty-graph latency")
    empty = empty_graph_latency(bundle, plan.empty_graph_calls)
    figures = asyncio.run(_measure_engine(engine, plan, progress))
    figures["empty_graph"] = empty
    progress.step("NPU matmuls at the prefill plan's shapes")
    figures["npu_matmul"] = npu_matmul.measure(plan.matmul_runs)
    return figures


def bundle_root(path: Path | None) -> Path:
    """The bundle a run measures: ``path``, or the embedded demo bundle."""
    if path is not None:
        return path
    from ling3_rknn.demo import bundle_dir

    return bundle_dir()

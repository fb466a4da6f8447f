"""Time per decoded token split by component, measured inside the live model.

The engine calls ``model.forward``, which calls ``model.stages`` (the stage graphs: the
NPU on a board) and ``model.experts`` (routed experts on the CPU kernels); the rest of a
forward is CPU glue (KDA recurrence, MLA attention, routing). Wrapping those attributes
(as tests/bench/bench_side_by_side.py does) measures the product's own path with no
second loop. Single-token forwards are decode steps; longer ones are prefill chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Split:
    """Seconds spent per component over ``forwards`` model calls of one kind."""

    forwards: int = 0
    tokens: int = 0
    total: float = 0.0
    stages: float = 0.0
    experts: float = 0.0
    graph_calls: int = 0
    # prefill attention on the NPU (mla_npu.py): its wall time, and inside it the matmul
    # runs and the CPU's softmax, each summed over the NPU cores' threads
    npu_attention: float = 0.0
    attention_matmul: float = 0.0
    attention_softmax: float = 0.0
    # two pieces in flight (model/pipeline.py): the components above ran this much longer
    # in sum than the forwards' wall time
    overlap: float = 0.0

    def per_token_ms(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        n = self.tokens
        # with pieces in flight the components overlap: they add up to wall time + overlap
        busy = self.total + self.overlap
        glue = busy - self.stages - self.experts - self.npu_attention
        out = {"forward": 1e3 * self.total / n, "npu_stages": 1e3 * self.stages / n,
               "experts": 1e3 * self.experts / n, "cpu_glue": 1e3 * glue / n}
        if self.overlap:
            out["pipeline_overlap"] = 1e3 * self.overlap / n
        if self.npu_attention:
            out.update(npu_attention=1e3 * self.npu_attention / n,
                       npu_attention_matmul_busy=1e3 * self.attention_matmul / n,
                       npu_attention_cpu_softmax=1e3 * self.attention_softmax / n)
        return out


@dataclass
class ComponentTimers:
    """Accumulates into ``decode`` or ``prefill`` depending on the forward in progress."""

    decode: Split = field(default_factory=Split)
    prefill: Split = field(default_factory=Split)
    _current: Split | None = None

    def reset(self) -> None:
        self.decode, self.prefill = Split(), Split()

    def _timed(self, bucket: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            split = self._current
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if split is not None:
                    setattr(split, bucket, getattr(split, bucket) + time.perf_counter() - t0)
        return timed

    def install(self, model: Any) -> None:
        """Wrap ``model.forward``, ``model.stages`` and ``model.experts`` in place."""
        stages, forward = model.stages, model.forward
        model.stages = _TimedStages(stages, self._timed)
        model.experts = self._timed("experts", model.experts)
        attention = getattr(model, "npu_attention", None)
        if attention is not None:
            attention.attend = self._timed_attention(attention)

        def timed_forward(token_ids: Any, state: Any, **kwargs: Any) -> Any:
            split = self.decode if len(token_ids) == 1 else self.prefill
            self._current = split
            calls = getattr(stages, "calls", 0)
            overlap = getattr(model, "pipeline_overlap_s", 0.0)
            t0 = time.perf_counter()
            try:
                return forward(token_ids, state, **kwargs)
            finally:
                split.total += time.perf_counter() - t0
                split.overlap += getattr(model, "pipeline_overlap_s", 0.0) - overlap
                split.forwards += 1
                split.tokens += len(token_ids)
                split.graph_calls += getattr(stages, "calls", 0) - calls
                self._current = None

        model.forward = timed_forward


    def _timed_attention(self, attention: Any) -> Callable[..., Any]:
        attend, counters = attention.attend, attention.counters

        def timed(*args: Any, **kwargs: Any) -> Any:
            split = self._current
            before = (counters.matmul_s, counters.softmax_s)
            t0 = time.perf_counter()
            try:
                return attend(*args, **kwargs)
            finally:
                if split is not None:
                    split.npu_attention += time.perf_counter() - t0
                    split.attention_matmul += counters.matmul_s - before[0]
                    split.attention_softmax += counters.softmax_s - before[1]
        return timed


class _TimedStages:
    """The stage backend with its graph methods timed into the ``stages`` bucket; ``embed``
    (a CPU table lookup, no graph) counts as glue, plain attributes (``calls``) pass."""

    def __init__(self, inner: Any, timed: Callable[[str, Callable[..., Any]], Callable[..., Any]]
                 ) -> None:
        self._inner, self._timed = inner, timed

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        return self._timed("stages", attr) if callable(attr) and name != "embed" else attr

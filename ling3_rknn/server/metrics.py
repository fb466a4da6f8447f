"""Prometheus metrics for ``GET /metrics``.

prometheus-client (pure Python, no dependencies) writes the text exposition format and
its escaping; hand-writing it is easy to get subtly wrong. HTTP-level counters live here;
model-level figures (tokens, speeds, prefix cache, queue, NPU errors) are read from
``engine.stats()`` at scrape time by a custom collector, so they are never double-counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ling3_rknn.engine.api import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "ling3"


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        ready = GaugeMetricFamily(f"{PREFIX}_model_ready", "1 once the model is loaded.")
        ready.add_metric([], 0.0 if stats is None else 1.0)
        yield ready
        if stats is None:
            return
        counters = {
            "engine_requests": (stats.requests, "Generations started by the engine."),
            "prompt_tokens": (stats.prompt_tokens, "Prompt tokens received (tokens in)."),
            "completion_tokens": (stats.completion_tokens, "Tokens generated (tokens out)."),
            "prefill_tokens": (stats.prefill_tokens, "Prompt tokens actually evaluated."),
            "prefill_seconds": (stats.prefill_seconds, "Time spent in prefill."),
            "decode_tokens": (stats.decode_tokens, "Tokens decoded."),
            "decode_seconds": (stats.decode_seconds, "Time spent decoding."),
            "prefix_cache_hits": (stats.cache_hits, "Prompts that restored a cached prefix."),
            "prefix_cache_reused_tokens": (
                stats.cache_tokens_reused,
                "Prompt tokens restored from the prefix cache instead of evaluated.",
            ),
            "npu_errors": (stats.npu_errors, "NPU failures seen by the engine."),
            "engine_cancelled": (
                stats.cancelled,
                "Generations cancelled because their consumer went away.",
            ),
        }
        for name, (value, doc) in counters.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(value))
            yield family
        gauges = {
            "prefill_tokens_per_second": (
                _rate(stats.prefill_tokens, stats.prefill_seconds),
                "Mean prefill speed since start.",
            ),
            "decode_tokens_per_second": (
                _rate(stats.decode_tokens, stats.decode_seconds),
                "Mean decode speed since start.",
            ),
            "prefix_cache_bytes": (stats.cache_bytes, "Bytes of snapshots held in memory."),
            "prefix_cache_disk_bytes": (stats.cache_disk_bytes, "Bytes of snapshots on disk."),
            "prefix_cache_entries": (stats.cache_entries, "Snapshots indexed (memory or disk)."),
            "queue_depth": (stats.queue_depth, "Generations waiting for the model."),
            "grammar_cache_bytes": (
                stats.grammar_cache_bytes,
                "Memory counted for compiled grammars kept for reuse (an estimate from their "
                "size; bounded by the engine's grammar cache budget).",
            ),
            "grammar_cache_entries": (stats.grammar_cache_entries, "Compiled grammars kept."),
        }
        for name, (value, doc) in gauges.items():
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            gauge.add_metric([], float(value))
            yield gauge


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


class ServerMetrics:
    """One registry per app, so tests and several apps in one process never collide."""

    def __init__(self, engine_stats: Callable[[], EngineStats | None]) -> None:
        # No "<name>_created" timestamp series: noise for a single-process server
        # (a process-wide prometheus-client switch; this server is its only user).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.completions = Counter(
            f"{PREFIX}_chat_completions",
            "Chat completions finished, by mode and finish reason.",
            ["stream", "finish_reason"],
            registry=self.registry,
        )
        self.constrained = Counter(
            f"{PREFIX}_constrained_completions",
            "Chat completions served under a grammar (docs/serving.md 9), by what it "
            "enforced: named, required, allowed_tools, response_format, tools, or auto "
            "(plain auto with tools: the lazy grammar of its calls, 9.1).",
            ["kind"],
            registry=self.registry,
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors",
            "Error answers (HTTP errors and errors ending a stream) by kind: client (the "
            "request was invalid), device (the model or NPU failed), unavailable (busy, "
            "loading, shutting down) or internal.",
            ["kind"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            f"{PREFIX}_client_disconnects",
            "Requests ended because the client went away (a 499, or a stream cut short).",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight",
            "Chat completions being served now.",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From request received to first generated text.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

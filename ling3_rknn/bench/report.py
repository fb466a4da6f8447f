"""The bench report: one JSON document, keyed so reports compare across boards/releases.

Per-size figures are keyed by the requested prompt size (``"128"``, ``"466"``, ...); the
exact token counts are in ``runs``. Speeds are reported, never judged here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .npu_matmul import summary_lines as matmul_lines

SCHEMA = 1


def _by_size(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {str(r["target"]): r[key] for r in runs}


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def build_report(figures: dict[str, Any], *, executor: str, machine: dict[str, Any],
                 bundle: dict[str, Any], quick: bool, load_s: float, rss: tuple[int, int],
                 npu_resident_bytes: int, memory: dict[str, int | None] | None = None
                 ) -> dict[str, Any]:
    runs = figures["runs"]
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "executor": executor,
        "machine": machine,
        "bundle": bundle,
        "load_s": load_s,
        "prefill_tok_s": _by_size(runs, "prefill_tok_s"),
        "decode_tok_s": _by_size(runs, "decode_tok_s"),
        "ttft_s": _by_size(runs, "ttft_s"),
        "ms_per_token": _by_size(runs, "ms_per_token"),
        "prefill_ms_per_token": _by_size(runs, "prefill_ms_per_token"),
        "npu_calls_per_token": {
            "decode": _mean([r["npu_calls_per_token"] for r in runs]),
            "prefill": _mean([r["npu_calls_per_prefill_token"] for r in runs]),
        },
        "prefix_cache": figures["prefix_cache"],
        "agent_first_request": figures["agent_first_request"],
        "empty_graph": figures["empty_graph"],
        # per prefill-plan shape: us_per_run, gops, npu_us_per_run, npu_gops (npu_matmul.py)
        "npu_matmul": figures.get("npu_matmul"),
        "memory": memory,  # the prefix cache's and the prefill scratch's sizes, and from what
        "rss_bytes": rss[0],
        "rss_peak_bytes": rss[1],
        "npu_resident_bytes": npu_resident_bytes,
        "runs": runs,
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(report: dict[str, Any]) -> str:
    """A short human table of the report (printed after a run)."""
    lines = [f"executor {report['executor']}, bundle {report['bundle']['model_id']} "
             f"({report['bundle']['target']}), {report['machine']['cpu_model']}",
             f"{'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'ttft s':>8}   "
             "ms/token: npu / experts / glue / engine"]
    for r in report["runs"]:
        ms = r["ms_per_token"]
        lines.append(
            f"{r['prompt_tokens']:>7} {_fmt(r['prefill_tok_s']):>14} "
            f"{_fmt(r['decode_tok_s']):>13} {_fmt(r['ttft_s'], 3):>8}   "
            + " / ".join(_fmt(ms.get(k), 2) for k in ("npu_stages", "experts", "cpu_glue",
                                                        "engine")))
    pc = report["prefix_cache"]
    agent = report["agent_first_request"]
    calls = report["npu_calls_per_token"]
    empty = report["empty_graph"]
    lines += [
        f"agent loop turn 2: {pc['turn2_cached_tokens']} of {pc['turn2_prompt_tokens']} "
        f"prompt tokens cached, {pc['turn2_evaluated_tokens']} evaluated",
        f"agent first request: {agent['prompt_tokens']} tokens, first token after "
        f"{_fmt(agent['ttft_s'], 2)} s; next session {_fmt(agent['next_session_ttft_s'], 2)} s "
        f"({agent['next_session_cached_tokens']} of {agent['next_session_prompt_tokens']} "
        "cached)",
        f"NPU calls per decoded token {_fmt(calls['decode'])}; empty-graph call "
        f"({empty['stage']}) {_fmt(empty['median_us'], 0)} us median",
        f"RSS {report['rss_bytes'] / 2**20:.0f} MiB (peak {report['rss_peak_bytes'] / 2**20:.0f}"
        f"), NPU-resident {report['npu_resident_bytes'] / 2**20:.1f} MiB",
        *matmul_lines(report.get("npu_matmul")),
    ]
    return "\n".join(lines)

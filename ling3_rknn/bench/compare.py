"""``--compare OLD.json``: the ratio new/old of every figure two reports share.

The old report is read before the bench runs, so a wrong path fails at once with a clear
message (exit status 2) instead of after minutes of measuring.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Figures, not identity: these subtrees are compared leaf by leaf.
FIGURES = ("prefill_tok_s", "decode_tok_s", "ttft_s", "ms_per_token", "prefill_ms_per_token",
           "npu_calls_per_token",
           "prefix_cache", "agent_first_request", "empty_graph", "npu_matmul", "rss_bytes",
           "rss_peak_bytes", "npu_resident_bytes", "load_s")


class CompareError(ValueError):
    """The file given to ``--compare`` is not a bench report."""


def load_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareError(f"--compare: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompareError(f"--compare: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise CompareError(f"--compare: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not any(k in data for k in FIGURES):
        raise CompareError(f"--compare: {path} is not a ling3-rknn bench report "
                           f"(none of {', '.join(FIGURES[:3])}, ...)")
    return data


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, f"{prefix}.{key}")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield prefix, float(value)


def figures(report: dict[str, Any]) -> dict[str, float]:
    """Every numeric figure of a report, by dotted path (``prefill_tok_s.466``)."""
    return {path: v for key in FIGURES if key in report for path, v in _leaves(report[key], key)}


Row = tuple[str, float, float, float | None]


def ratios(new: dict[str, Any], old: dict[str, Any]) -> list[Row]:
    """(figure, new, old, new/old) for the figures both reports have."""
    a, b = figures(new), figures(old)
    return [(k, a[k], b[k], a[k] / b[k] if b[k] else None) for k in a if k in b]


def format_ratios(rows: list[Row]) -> str:
    width = max((len(r[0]) for r in rows), default=6)
    lines = [f"{'figure':<{width}} {'new':>12} {'old':>12} {'new/old':>8}"]
    for name, new, old, ratio in rows:
        shown = "-" if ratio is None else f"{ratio:.3f}"
        lines.append(f"{name:<{width}} {new:>12.4g} {old:>12.4g} {shown:>8}")
    return "\n".join(lines)

"""``--plot OUT.png``: tok/s against context length, and time per token by component.

matplotlib is the optional ``plot`` extra: serving never needs it, so it is imported here
only, and its absence is a clear error naming the extra (checked before the bench runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMPONENTS = (("npu_stages", "NPU stages"), ("experts", "experts"), ("cpu_glue", "CPU glue"),
              ("engine", "engine (sampling, text)"))


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'ling3-rknn[plot]'") \
            from None


def write_plot(report: dict[str, Any], path: Path) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a board or in CI
    import matplotlib.pyplot as plt

    runs = report["runs"]
    sizes = [r["prompt_tokens"] for r in runs]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
        speed.plot(sizes, [r[key] or 0.0 for r in runs], marker="o", label=label)
    speed.set_xscale("log", base=2)
    speed.set_xlabel("prompt tokens")
    speed.set_ylabel("tok/s")
    speed.set_title("speed against context length")
    speed.grid(True, alpha=0.3)
    speed.legend()

    slots = list(range(len(runs)))  # one bar per run, labelled by its prompt size
    bottom = [0.0] * len(runs)
    for key, label in COMPONENTS:
        values = [r["ms_per_token"].get(key, 0.0) for r in runs]
        split.bar(slots, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    split.set_xticks(slots, [str(s) for s in sizes])
    split.set_xlabel("prompt tokens")
    split.set_ylabel("ms per decoded token")
    split.set_title("time per token by component")
    split.legend(fontsize="small")

    bundle = report["bundle"]
    fig.suptitle(f"ling3-rknn bench: {bundle['model_id']} on {report['executor']} "
                 f"({report['machine']['cpu_model']})", fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)

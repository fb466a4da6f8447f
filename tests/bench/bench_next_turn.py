"""An agent's next turn at depth: the prefill of a turn's new tokens after a long conversation,
with the MLA rows projected for the expanded prefill form kept across the turn, and dropped.

The engine resumes every request from a snapshot (``Runner._resume``). When that snapshot is
the live state's own end of turn, ``SequenceState.restore`` keeps the projected rows
(``mla_expanded.PrefillScratch``) up to it, so the next turn projects only the rows added
since (the decoded tokens, the new prompt). Dropped, as every restore and decode token did
before, the next turn projects the whole conversation again, or pays the absorbed form's
attention over it. One run, per round: a ``--depth``-token random conversation fed in the
engine's prefill pieces, ``--decode`` decode tokens, the end-of-turn snapshot; ``--turn``
new tokens fed on without a restore (the reference), then resumed from the snapshot with the
rows kept (the turn's own snapshot: the logits must match the reference to float32 rounding,
the decoded tokens' rows being projected in another batch), then resumed from it again (now
a snapshot of an earlier history: the rows dropped). Dropped differs from kept in float32
rounding only (the prefix projected in one product, the absorbed form rented first), which a
bundle's quantized activations and its routing lift well above that: on a random checkpoint
a flipped expert choice moves the logits by percents. tests/test_mla_expanded.py pins both
paths to the float model. Nothing asserts on time.

    .venv/bin/python tests/bench/bench_next_turn.py [--bundle DIR] [--threads N]
        [--depth 16384] [--turn 512] [--decode 16] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ling3_rknn.cpu_threads import apply_thread_policy
from ling3_rknn.demo import bundle_dir
from ling3_rknn.model import Model
from ling3_rknn.model.state import SequenceState


def _feed(model: Model, state: SequenceState, ids: np.ndarray, piece: int) -> tuple[float, Any]:
    """Seconds to prefill ``ids`` in the engine's pieces, and the last logits row."""
    t0 = time.perf_counter()
    logits = None
    for a in range(0, len(ids), piece):
        logits = model.forward(ids[a:a + piece], state, last_only=True)
    return time.perf_counter() - t0, logits


def _rows(state: SequenceState) -> int:
    return min((r.length for r in state.prefill_scratch.rows.values()), default=0)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=None, help="default: the embedded demo")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--turn", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    policy = apply_thread_policy(args.threads)
    model = Model.from_bundle(args.bundle or bundle_dir(), threads=policy.threads, verify="size")
    piece = model.prefill_chunk
    rng = np.random.default_rng(args.seed)
    vocab = int(model.config.vocab_size)
    result: dict[str, Any] = {
        "bundle": str(args.bundle or bundle_dir()), "threads": policy.threads,
        "depth": args.depth, "turn": args.turn, "decode": args.decode, "piece": piece,
        "load_start": os.getloadavg(), "rounds": [],
    }
    print(f"threads {policy.threads}, pieces of {piece}; load average {os.getloadavg()}")
    for rnd in range(args.rounds):
        state = model.new_state()
        conversation = rng.integers(0, vocab, args.depth)
        first, _ = _feed(model, state, conversation, piece)
        for token in rng.integers(0, vocab, args.decode):
            model.forward([int(token)], state, last_only=True)
        turn_end = state.snapshot()
        new = rng.integers(0, vocab, args.turn)
        # the turn continued without a restore: what the kept rows must reproduce
        _, continued_logits = _feed(model, state, new, piece)
        state.restore(turn_end)  # the live state's own end of turn: rows kept up to it
        kept_rows = _rows(state)
        kept, kept_logits = _feed(model, state, new, piece)
        # rows for every position: the kept turn ran the expanded form (not so without
        # the kernels, or past --prefill-scratch: then kept and dropped are both absorbed)
        expanded = _rows(state) == state.length
        state.restore(turn_end)  # an earlier history now: rows dropped
        dropped, dropped_logits = _feed(model, state, new, piece)
        row = {"first_turn_s": first, "rows_kept": kept_rows, "expanded": expanded,
               "next_turn_kept_s": kept,
               "next_turn_dropped_s": dropped,
               "kept_vs_continued": _rel(kept_logits, continued_logits),
               "kept_vs_dropped": _rel(kept_logits, dropped_logits)}
        result["rounds"].append(row)
        print(f"round {rnd + 1}: {args.depth}-token conversation in {first:.2f} s; next turn "
              f"of {args.turn} tokens: rows kept ({kept_rows}) {kept:.3f} s, dropped "
              f"{dropped:.3f} s ({dropped / kept:.2f}x); logits rel diff kept vs never "
              f"restored {row['kept_vs_continued']:.1e}, vs dropped "
              f"{row['kept_vs_dropped']:.1e}"
              + ("" if expanded else "; WARNING: the turn ran absorbed (no kernels, or past "
                                     "--prefill-scratch): the rows did not matter"))
    result["load_end"] = os.getloadavg()
    best_kept = min(r["next_turn_kept_s"] for r in result["rounds"])
    best_dropped = min(r["next_turn_dropped_s"] for r in result["rounds"])
    print(f"best of rounds: kept {best_kept:.3f} s, dropped {best_dropped:.3f} s "
          f"({best_dropped / best_kept:.2f}x); load average {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

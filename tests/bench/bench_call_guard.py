"""What the call guard costs per sampled token at Ling-3.0-tiny's vocabulary (157,184).

The engine's own objects (``engine.call_guard``, ``engine.grammar_constraint``) on the
synthetic byte-level vocabulary of ``bench_grammar.py`` with its 20 agent-like tools, the
time of ``mask`` + ``advance`` per sampled token:

- no constraint at all (a copy of the row, what the sampler's input costs anyway),
- the marker ban (no tools or ``tool_choice: "none"``: one add of a cached row),
- the lazy grammar of ``auto`` before its trigger (the same ban, plus a trigger check),
- the lazy grammar inside a call (llguidance's mask over the vocabulary, random walks
  through declared calls), and the whole-turn ``required`` grammar for comparison;
- the one-off cost of an auto request's lazy grammar (compiled at admission, then cached).

    .venv/bin/python tests/bench/bench_call_guard.py [--tokens 3000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_grammar import synthetic_spec, tools

from ling3_rknn.chat import markers, turn_grammar
from ling3_rknn.engine.call_guard import BanRows, LazyCalls, MarkerBan
from ling3_rknn.engine.grammar_constraint import GrammarCompiler
from ling3_rknn.tokenizer import Tokenizer


def _ms(samples: list[float]) -> str:
    return (f"median {statistics.median(samples):.4f} mean {statistics.fmean(samples):.4f} "
            f"p90 {float(np.percentile(samples, 90)):.4f} ms")


def _free(constraint, logits: np.ndarray, plain: list[int], n: int) -> list[float]:
    """Per-token cost while the answer is free text (never the trigger)."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        constraint.mask(logits)
        constraint.advance(plain[i % len(plain)])
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _calls(make, logits: np.ndarray, rng: np.random.Generator, n: int, eos: int,
           specials: set[int]) -> list[float]:
    """Per sampled token inside calls: random walks through what the grammar allows."""
    out: list[float] = []
    while len(out) < n:
        constraint = make()
        for _ in range(300):
            t0 = time.perf_counter()
            masked = constraint.mask(logits)
            dt = time.perf_counter() - t0
            allowed = np.flatnonzero(np.isfinite(masked))
            marked = [i for i in allowed[:64] if int(i) in specials and int(i) != eos]
            token = int(rng.choice(marked)) if marked and rng.random() < 0.2 else int(
                rng.choice(allowed))
            if token == eos:
                break
            t0 = time.perf_counter()
            constraint.advance(token)
            out.append((dt + time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3000, help="sampled tokens per figure")
    args = parser.parse_args()
    tok = Tokenizer(synthetic_spec())
    ids = tok.special_ids
    compiler = GrammarCompiler(tok)
    compiler.prepare()
    declared = tools()
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
    plain = [i for i in range(300, 5000) if "<" not in tok.decode([i])]
    specials = set(ids.values())
    rows = BanRows()
    print(f"vocabulary {tok.vocab_size:,} ids, {len(declared)} tools; per sampled token "
          "(mask + advance):")

    class Nothing:
        def mask(self, row: np.ndarray) -> np.ndarray:
            return row.copy()

        def advance(self, token: int) -> list[int]:
            return []

    n = args.tokens
    print(f"  no constraint (a row copy)        {_ms(_free(Nothing(), logits, plain, n))}")
    ban = MarkerBan(rows, [ids[m] for m in markers.CALL_MARKERS])
    print(f"  marker ban (no tools / none)      {_ms(_free(ban, logits, plain, args.tokens))}")
    lazy = turn_grammar(declared, thinking=True)
    t0 = time.perf_counter()
    compiler.compile(lazy)
    first = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiler.compile(lazy)
    again = (time.perf_counter() - t0) * 1e3
    body = [ids[m] for m in markers.CALL_BODY_MARKERS]

    def make_lazy() -> LazyCalls:
        return LazyCalls(compiler.compile(lazy), ids[markers.TOOL_CALL_OPEN],
                         MarkerBan(rows, body))

    print(f"  auto, before the trigger          {_ms(_free(make_lazy(), logits, plain, n))}")

    def entered() -> LazyCalls:
        constraint = make_lazy()
        constraint.advance(ids[markers.TOOL_CALL_OPEN])
        return constraint

    inside = _calls(entered, logits, rng, args.tokens, tok.eos_id, specials)
    print(f"  auto, inside a call               {_ms(inside)}")
    required = turn_grammar(declared, tool_choice="required", thinking=False)
    whole = _calls(lambda: compiler.compile(required), logits, rng, args.tokens, tok.eos_id,
                   specials)
    print(f"  required (whole-turn grammar)     {_ms(whole)}")
    print(f"auto's lazy grammar per request: {first:.1f} ms the first time, {again:.2f} ms "
          "once compiled (kept by its text)")


if __name__ == "__main__":
    main()

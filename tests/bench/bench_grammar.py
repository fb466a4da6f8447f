"""Constrained-decoding cost at Ling-3.0-tiny's vocabulary (157,184) with 20 declared tools.

Prints, for the product path (``chat.turn_grammar`` + ``engine.grammar_constraint``):
- the one-off build of llguidance's tokenizer view (first constrained request per process),
- the per-request grammar build (Lark text + matcher compile), for a new grammar and for
  the same grammar again (agents send the same tools every turn: the compiled matcher is
  kept and copied),
- per token: the mask llguidance computes, and the whole step the engine pays
  (mask + applying it to a logits row + advancing the matcher), median, mean and p90, over
  random walks through the grammar (reasoning, calls, raw strings, JSON values).

The real tokenizer is not available here, so the vocabulary is synthetic: byte-level BPE
pieces of English, code and JSON shapes built from a seeded generator, with Ling's special
tokens. Mask cost depends on the token trie and the lexer states, which this reproduces in
size and byte distribution, not token for token.

    .venv/bin/python tests/bench/bench_grammar.py [--steps 2000] [--requests 12]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from ling3_rknn.chat import markers, turn_grammar
from ling3_rknn.engine.grammar_constraint import GrammarCompiler
from ling3_rknn.tokenizer import Tokenizer

VOCAB = 157_184
SYLLABLES = (
    "a", "e", "i", "o", "u", "an", "en", "in", "on", "un", "ar", "er", "ir", "or", "ur", "al",
    "el", "il", "ol", "ul", "at", "et", "it", "ot", "ut", "st", "th", "ch", "sh", "re", "de",
    "le", "se", "te", "ne", "me", "pe", "ke", "be", "ge", "ve", "ce", "ze", "ing", "ion", "ent",
    "ous", "ive", "ful", "est", "ment", "ness", "able", "ight", "ough", "ture"
)
CODE = (
    "def", "class", "return", "import", "from", "self", "None", "True", "False", "print",
    "json", "path", "file", "data", "value", "key", "name", "args", "kwargs", "list", "dict",
    "str", "int", "float", "bool", "async", "await", "yield", "lambda", "with", "open", "read",
    "write", "request", "response", "error", "status", "query", "result"
)
PUNCT = (
    *list("{}[]()<>:;,.!?=+-*/\\|\"'`~@#$%^&_"), '":', '",', '{"', '"}', '": "', "\\n", "    ",
    "\n", "\n\n", "  ", "->", "=="
)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (what byte-level BPE vocabularies use)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def synthetic_spec(seed: int = 0) -> dict:
    rng = random.Random(seed)
    alphabet = _byte_alphabet()

    def piece(text: str) -> str:
        return "".join(alphabet[b] for b in text.encode("utf-8"))

    specials = list(markers.CONTROL_MARKERS)
    vocab: dict[str, int] = {}
    for name in specials:
        vocab[name] = len(vocab)
    for b in range(256):
        vocab.setdefault(alphabet[b], len(vocab))
    while len(vocab) < VOCAB:
        kind = rng.random()
        if kind < 0.55:
            word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        elif kind < 0.75:
            word = rng.choice(CODE) + rng.choice(["", "_" + rng.choice(CODE), "s", "ed", "()"])
        elif kind < 0.85:
            word = str(rng.randint(0, 99999))
        else:
            word = "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.3:
            word = word.capitalize()
        if rng.random() < 0.5:
            word = " " + word
        vocab.setdefault(piece(word), len(vocab))
    added = [{"id": vocab[n], "content": n, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for n in specials]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def tools(n: int = 20) -> list[dict]:
    """Agent-like declarations: paths, commands, flags, enums, nested options."""
    out = []
    for i in range(n):
        props = {
            "path": {"type": "string", "description": "file path"},
            "mode": {"type": "string", "enum": ["read", "write", "append"]},
            "limit": {"type": "integer", "minimum": 1, "maximum": 10_000},
            "recursive": {"type": "boolean"},
            "options": {"type": "object", "properties": {
                "encoding": {"type": "string"}, "timeout": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "string"}},
        }
        keys = list(props)[: 2 + i % 5]
        out.append({"type": "function", "function": {
            "name": f"tool_{i:02d}_{CODE[i % len(CODE)]}",
            "description": f"Tool number {i}.",
            "parameters": {"type": "object", "properties": {k: props[k] for k in keys},
                           "required": keys[:1]}}})
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="sampled tokens in all")
    parser.add_argument("--max-turn", type=int, default=300, help="tokens per turn at most")
    parser.add_argument("--requests", type=int, default=12,
                        help="grammars built (the engine keeps the last 16 compiled)")
    args = parser.parse_args()

    tok = Tokenizer(synthetic_spec())
    print(f"vocabulary {tok.vocab_size:,} ids (synthetic byte-level BPE, Ling's markers)")
    compiler = GrammarCompiler(tok)
    declared = tools()
    grammar = turn_grammar(declared, tool_choice="required", thinking=True)
    t0 = time.perf_counter()
    compiler.compile(grammar)
    print(f"first constrained request (llguidance tokenizer view + grammar): "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms, once per process")

    def build_ms(rotation: int) -> float:
        rotated = declared[rotation:] + declared[:rotation]  # same tools, another grammar
        t0 = time.perf_counter()
        compiler.compile(turn_grammar(rotated, tool_choice="required", thinking=True))
        return (time.perf_counter() - t0) * 1e3

    rotations = [i % len(declared) for i in range(1, args.requests + 1)]
    cold = [build_ms(r) for r in rotations]  # a grammar the engine has not compiled yet
    warm = [build_ms(r) for r in rotations]  # the same tools again (an agent's next turn)
    print(f"grammar per request, 20 tools: new grammar median {statistics.median(cold):.2f} ms "
          f"(p90 {_pct(cold, 90):.2f}); same grammar again (an agent's next turn) median "
          f"{statistics.median(warm):.2f} ms")

    rng = np.random.default_rng(0)
    specials = set(tok.special_ids.values())
    logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
    # (llguidance mask ms, whole engine step ms, allowed tokens) per sampled token
    samples: list[tuple[float, float, int]] = []
    modes = [dict(tool_choice="required", thinking=True),
             dict(tool_choice="required", forced_tool=declared[7]["function"]["name"],
                  thinking=False),
             dict(tool_choice="auto", parallel_tool_calls=False, thinking=False)]
    turns = 0
    while len(samples) < args.steps:
        constraint = compiler.compile(turn_grammar(declared, **modes[turns % len(modes)]))
        turns += 1
        matcher = constraint._matcher  # the mask alone, as llguidance computes it
        words = constraint._words
        for _ in range(args.max_turn):
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            mask = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            masked = constraint.mask(logits)
            step = (time.perf_counter() - t0) * 1e3
            ids = np.flatnonzero(np.isfinite(masked))
            # Take a marker now and then (they are the low ids) so turns leave free text.
            marked = [i for i in ids[:64] if int(i) in specials and int(i) != tok.eos_id]
            token = int(rng.choice(marked)) if marked and rng.random() < 0.2 else int(
                rng.choice(ids))
            t0 = time.perf_counter()
            if token != tok.eos_id:
                constraint.advance(token)
            step += (time.perf_counter() - t0) * 1e3
            samples.append((mask, step, ids.size))
            if token == tok.eos_id:
                break

    def report(label: str, rows: list[tuple[float, float, int]]) -> None:
        if not rows:
            return
        mask = [r[0] for r in rows]
        step = [r[1] for r in rows]
        print(f"  {label:<34} {len(rows):>5} tokens  mask median {statistics.median(mask):.3f}"
              f" mean {statistics.fmean(mask):.3f} p90 {_pct(mask, 90):.3f} max "
              f"{max(mask):.3f} ms | engine step median {statistics.median(step):.3f} "
              f"mean {statistics.fmean(step):.3f} ms")

    print(f"per sampled token over {turns} random turns (forced tokens are not sampled):")
    report("all", samples)
    report("free text (>= 100K tokens allowed)", [r for r in samples if r[2] >= 100_000])
    report("structure (< 100K allowed)", [r for r in samples if r[2] < 100_000])
    print("  target: mask <= 0.3 ms per token. The engine step is what the worker pays per "
          f"sampled token: the mask, applying it to a {tok.vocab_size:,}-logit row, and "
          "advancing the matcher (forced tokens included)")


if __name__ == "__main__":
    main()

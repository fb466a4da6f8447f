"""The compiled-grammar cache of ``engine/grammar_constraint.py``: least recently used out
first, bounded by count and by bytes, and its size reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from ling3_rknn.chat import turn_grammar
from ling3_rknn.engine import grammar_constraint
from ling3_rknn.engine.grammar_constraint import GrammarCompiler, grammar_charge
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


def _grammar(name: str, properties: int = 1):
    schema = {"type": "object", "properties": {f"{name}{j}": {"type": "integer"}
                                               for j in range(properties)}}
    return turn_grammar(None, response_schema=schema, thinking=False)


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The grammar texts llguidance actually compiled (a cache miss each)."""
    seen: list[str] = []
    real = grammar_constraint.llguidance.LLMatcher

    def counting(ll, text, **kwargs):
        seen.append(text)
        return real(ll, text, **kwargs)

    monkeypatch.setattr(grammar_constraint.llguidance, "LLMatcher", counting)
    return seen


def test_the_least_recently_used_grammar_is_evicted_first(tok, compiles):
    compiler = GrammarCompiler(tok, cached_grammars=2)
    a, b, c = _grammar("a"), _grammar("b"), _grammar("c")
    compiler.compile(a)
    compiler.compile(b)
    compiler.compile(a)  # a hit: a is now the most recent, b the oldest
    assert len(compiles) == 2
    compiler.compile(c)  # evicts b
    compiler.compile(a)  # still cached
    assert len(compiles) == 3
    compiler.compile(b)  # was evicted: compiled again
    assert len(compiles) == 4
    assert compiler.entries == 2


def test_the_cache_is_bounded_in_bytes_and_reports_them(tok, compiles):
    big = [_grammar(f"g{i}_", 200) for i in range(6)]
    one = grammar_charge(big[0].lark(tok.special_ids).lark)
    compiler = GrammarCompiler(tok, cached_grammars=16, cache_bytes=int(2.5 * one))
    for grammar in big:
        compiler.compile(grammar)
    assert compiler.entries == 2
    assert 0 < compiler.bytes_held <= int(2.5 * one)
    compiler.compile(big[-1])  # the newest two are the ones kept
    compiler.compile(big[-2])
    assert len(compiles) == 6
    tiny = GrammarCompiler(tok, cache_bytes=one // 2)  # larger than the budget: not kept
    tiny.compile(big[0])
    assert tiny.entries == 0 and tiny.bytes_held == 0

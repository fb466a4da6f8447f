"""Token masks for constrained decoding, computed by llguidance.

Why llguidance rather than a grammar engine of our own or another library: it computes the
mask of a 157K-token vocabulary in tens of microseconds from a Rust core (an Earley parser
over lazily built lexer DFAs, what llama.cpp uses for the same job), compiles JSON Schema
and Lark (with regex intersection and negation, which the turn grammar needs to keep free
text from spelling a marker), reads a ``tokenizers`` JSON directly, and ships abi3 wheels
for x86_64 and aarch64 (the board) with no dependency of its own. xgrammar's wheel requires
torch and transformers, which the runtime keeps off the board; outlines-core compiles an
index per regex up front rather than masks lazily, and has no Lark grammars.

The engine compiles each request's grammar once at admission (a compile error is the
request's 400, naming the part it came from) and the worker asks for a mask before every
sampled token and advances the matcher with every token the turn gets, sampled or forced.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import llguidance
import numpy as np

from ling3_rknn.chat import GrammarError, markers

from .api import GrammarSource, GrammarText, InvalidRequest

log = logging.getLogger(__name__)


class GrammarTokenizer(Protocol):
    """What the compiler needs from the tokenizer (``ling3_rknn.tokenizer.Tokenizer``)."""

    @property
    def eos_id(self) -> int: ...

    @property
    def special_ids(self) -> Mapping[str, int]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def forbidden_ids(self) -> frozenset[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def encode_text(self, text: str) -> list[int]: ...


class _TextOnlyTokenizer:
    """llguidance's view of the tokenizer (its ``TokenizerWrapper`` protocol): every id's
    bytes, which ids are special, and an encoder for the text the grammar forces. Built
    from the tokenizer's JSON instead, llguidance tokenizes forced text with the added-token
    table, so a ``const`` that spells ``<role>`` would be forced as the special id, which
    the grammar (text there) then rejects. Here forced text is encoded as text, as the
    trust boundary encodes every TEXT segment (docs/serving.md 4)."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.eos_token_id = int(tokenizer.eos_id)
        self.bos_token_id = None
        self.special_token_ids = sorted(int(i) for i in tokenizer.forbidden_ids)
        self.tokens = [self._bytes(tokenizer, i) for i in range(int(tokenizer.vocab_size))]
        self._encode = tokenizer.encode_text

    @staticmethod
    def _bytes(tokenizer: GrammarTokenizer, token_id: int) -> bytes:
        try:
            return tokenizer.token_bytes(token_id)
        except ValueError:  # a hole in the id range
            return b""

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


# llguidance allows a whole "slice" of the vocabulary at once where the lexer state admits
# every token of it, and walks the token trie elsewhere (2-3 ms at 157K tokens). Its
# general slices are cut for JSON strings; the turn grammar's free text admits anything
# without "<" (chat/turn_grammar.py), so the first slices hold tokens that both admit.
_COMMON = r'[^<"\\\x00-\x1F\x7F]'
SLICES = [f"{_COMMON}{{1,10}}", f"{_COMMON}{{1,30}}", f"{_COMMON}+",
          *llguidance.LLTokenizer.general_slices()]


# llguidance does not report a compiled grammar's size; measured (RSS after compiling,
# this host) it holds 30 to 150 bytes per byte of Lark text (2,000 tools: ~20 MB for 683
# KB; a 10,000-property schema: 20-50 MB for 311 KB), so the cache charges 128 per byte.
BYTES_PER_GRAMMAR_CHAR = 128
DEFAULT_GRAMMAR_CACHE_BYTES = 128 << 20


def grammar_charge(text: str) -> int:
    """The memory a compiled grammar of ``text`` is counted as holding."""
    return (BYTES_PER_GRAMMAR_CHAR + 1) * len(text)


class GrammarCompiler:
    """Compiles turn grammars for one tokenizer. llguidance's tokenizer view takes about a
    second to build at Ling's vocabulary and holds the GIL meanwhile, so ``prepare`` builds
    it while the model loads rather than stalling the server on the first constrained
    request."""

    def __init__(self, tokenizer: GrammarTokenizer, cached_grammars: int = 16,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._unreadable: str | None = None
        # An agent sends the same tools every turn, so the same grammar: compiled matchers
        # are kept by their text (LRU, the least recently used out first) and each request
        # gets a copy in its start state (0.02 ms instead of ~10 ms for 20 tools). Bounded
        # by count and by bytes (``grammar_charge``): 18 grammars of 10,000-property schemas
        # held 600 MB when only the count was bounded.
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cached_grammars = cached_grammars
        self._cache_bytes = cache_bytes
        self.bytes_held = 0

    @property
    def entries(self) -> int:
        return len(self._compiled)

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now, where the tokenizer allows it. A
        tokenizer llguidance cannot read is logged; constrained requests then get the 400
        from ``compile``, and the server still serves the rest."""
        try:
            self._ll_tokenizer()
        except InvalidRequest as exc:  # the message says what llguidance could not read
            log.warning("%s", exc)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if self._unreadable is not None:
                    raise InvalidRequest(self._unreadable)
                try:
                    self._ll = llguidance.LLTokenizer(
                        llguidance.TokenizerWrapper(_TextOnlyTokenizer(self._tokenizer)),
                        n_vocab=int(self._tokenizer.vocab_size),
                        eos_token=int(self._tokenizer.eos_id),
                        slices=SLICES,
                    )
                except Exception as exc:  # the Rust side raises plain exceptions
                    self._unreadable = ("constrained decoding is not available: the "
                                        f"constraint library cannot read the tokenizer ({exc})")
                    raise InvalidRequest(self._unreadable) from exc
            return self._ll

    def compile(self, source: GrammarSource) -> TokenConstraint:
        """A fresh matcher for one request; InvalidRequest names what cannot be served."""
        ll = self._ll_tokenizer()
        text = self._text(source)
        key = text.lark
        with self._lock:
            start = self._compiled.get(key)
            if start is not None:
                self._compiled.move_to_end(key)
        grammar = source
        while start is None:
            matcher = llguidance.LLMatcher(ll, text.lark, log_level=0)
            if not matcher.is_error():
                start = matcher
                break
            error = _invalid(matcher.get_error(), text)
            # A tool whose schema is not the client's demand (a lenient one of an "auto"
            # turn) gets free arguments instead of failing the request (docs/serving.md 9).
            relaxed = grammar.relaxed(error.param)
            if relaxed is None:
                raise error
            grammar = relaxed
            text = self._text(grammar)
        self._keep(key, start)
        return TokenConstraint(start.deep_copy(), ll.vocab_size, self._value_bound(text))

    def _value_bound(self, text: GrammarText) -> ValueBound | None:
        """How to tell that a budget bound cut a string value (``chat.GrammarText.bounds``):
        the smallest bound and the ids that open and close a value."""
        bounds = [b for per_tool in text.bounds.values() for b in per_tool.values()]
        ids = self._tokenizer.special_ids
        if not bounds or markers.ARG_VALUE_OPEN not in ids or markers.ARG_VALUE_CLOSE not in ids:
            return None
        return ValueBound(min(bounds), int(ids[markers.ARG_VALUE_OPEN]),
                          int(ids[markers.ARG_VALUE_CLOSE]))

    def _keep(self, key: str, matcher: llguidance.LLMatcher) -> None:
        """Cache ``matcher`` under the text the request asked for, then evict the least
        recently used entries past either bound (one larger than the whole budget is
        used once and not kept)."""
        charge = grammar_charge(key)
        if charge > self._cache_bytes:
            return
        with self._lock:
            if key not in self._compiled:
                self.bytes_held += charge
            self._compiled[key] = matcher
            self._compiled.move_to_end(key)
            while (len(self._compiled) > self._cached_grammars
                   or self.bytes_held > self._cache_bytes):
                old, _ = self._compiled.popitem(last=False)
                self.bytes_held -= grammar_charge(old)

    def _text(self, source: GrammarSource) -> GrammarText:
        try:
            return source.lark(self._tokenizer.special_ids)
        except GrammarError as exc:  # a shape the grammar cannot express, and where
            raise InvalidRequest(str(exc), exc.part) from exc
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc


def _invalid(error: str, text: GrammarText) -> InvalidRequest:
    """llguidance's error (first line) as a 400 naming the request part its grammar line
    came from, where the error has a line."""
    first = error.strip().splitlines()[0] if error.strip() else "the grammar is invalid"
    place = re.match(r"(?:at )?(\d+)\(\d+\): ", first)
    part = None
    if place is not None:
        first = first[place.end():]
        part = text.part_at_line(int(place.group(1)))
    return InvalidRequest(f"{part or 'cannot constrain the answer'}: {first}", part)


# Bit j of mask byte b is token 8b + j (little-endian words): each byte value maps to the
# additive biases of its 8 tokens, 0 or -inf, so a 157K-row mask is one gather and one add
# (~0.07 ms, where np.where over a scattered boolean mask takes ~0.8 ms).
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0), np.float32(-np.inf),
).astype(np.float32)


@dataclass(frozen=True)
class ValueBound:
    """A budget bound on string values (in tokens) and the markers around a value."""

    tokens: int
    open_id: int
    close_id: int


class TokenConstraint:
    """One request's grammar state; used only by the engine's worker thread."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 value_bound: ValueBound | None = None) -> None:
        self._matcher = matcher
        self._words = np.empty((vocab_size + 31) // 32, np.int32)
        self._bound = value_bound
        self._run: int | None = None  # tokens of the value being written, None outside one
        self.cut_by_bound = False  # a string value reached the budget's bound (was cut)

    def _failed(self, what: str) -> Exception:
        """The matcher broke mid-answer (a limit of the library, reached by what this answer
        sampled): a 400 for the request, since the grammar and not the model is at fault.
        Not remembered: another answer under the same grammar may well finish."""
        error = self._matcher.get_error() or what
        return InvalidRequest("cannot constrain the answer: the grammar exceeded the "
                              f"constraint library's limits while generating ({error})")

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one logits row with every token the grammar forbids at -inf."""
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._matcher.is_error():
            raise self._failed("the mask could not be computed")
        if not words.any():
            raise self._failed("no token can continue the answer")
        n = logits.shape[0]
        bias = np.take(_BYTE_BIAS, words.view(np.uint8), axis=0).reshape(-1)
        if bias.shape[0] < n:  # ids past the tokenizer's vocabulary are never allowed
            bias = np.concatenate([bias, np.full(n - bias.shape[0], -np.inf, np.float32)])
        return logits + bias[:n]

    def advance(self, token_id: int) -> list[int]:
        """Accept ``token_id``; return the tokens the grammar now forces (already accepted
        too), which the engine evaluates in one model call instead of sampling one by one."""
        if not self._matcher.consume_token(int(token_id)):
            raise self._failed(f"token {token_id} does not continue the answer")
        self._track(token_id)
        if self._matcher.is_stopped():
            return []
        forced = list(self._matcher.compute_ff_tokens())
        if forced and not self._matcher.consume_tokens(forced):
            raise self._failed("the forced tokens were rejected")
        for token in forced:
            self._track(token)
        return forced

    def _track(self, token_id: int) -> None:
        """Count the tokens of each argument value; one that reaches the bound was cut
        there by the grammar (llguidance ends the lexeme at ``max_tokens``)."""
        bound = self._bound
        if bound is None:
            return
        if token_id == bound.open_id:
            self._run = 0
        elif token_id == bound.close_id:
            if self._run is not None and self._run >= bound.tokens:
                self.cut_by_bound = True
            self._run = None
        elif self._run is not None:
            self._run += 1

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

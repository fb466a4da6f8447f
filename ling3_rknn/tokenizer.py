"""Ling's byte-level BPE tokenizer with a trust boundary and a streaming detokenizer.

Encoding follows the typed segments the chat renderer produces: only CONTROL segments are
searched for special tokens; TEXT segments (user text, tool results, arguments) are encoded
as ordinary text even when they spell ``<|role_end|>`` or ``<tool_call>``, so attacker-influenced
text can never close a turn or fake a call. For text that spells no special token the ids are
exactly what ``tokenizers`` gives for the whole rendered string (the text between two special
tokens is encoded as one piece, the same split the library makes itself).

CONTROL text is matched against the added-token table by exact spelling; the ``lstrip``,
``rstrip`` and ``single_word`` flags of added tokens are not applied (they are false for the
chat markers in Ling-style tokenizers; the goldens test pins the ids to the library's own).

Decoding uses a byte table built from the vocabulary instead of ``tokenizers.decode`` so that a
stream of ids can be turned into text incrementally without ever emitting half a UTF-8
character; tests pin it to the library's own decode.

Leaf module: imports nothing from the rest of ``ling3_rknn`` but the chat format's marker
spellings (``chat.markers``) and what a prompt piece is (``chat.segments.SegmentLike``).
"""

from __future__ import annotations

import codecs
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ling3_rknn.chat import markers
from ling3_rknn.chat.segments import SegmentLike

# Template markers that must never be produced from TEXT (spelled in ``chat.markers``).
CONTROL_TOKEN_NAMES: tuple[str, ...] = markers.CONTROL_MARKERS


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or ids/segments it cannot handle."""


class TooManyTokens(TokenizerError):
    """Encoding stopped early: the text has at least ``at_least`` tokens, more than the
    caller's limit (the rest was never encoded)."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"the text has at least {at_least} tokens")
        self.at_least = at_least


class EncodingStopped(Exception):
    """The caller's ``stop`` check said to give up (its client left): the encoding ended
    between two pieces instead of running on for nobody. Not a TokenizerError: nothing
    was wrong with the text."""


Stop = Callable[[], bool]

# Long text runs are encoded in pieces of this many characters when the caller has a token
# limit: a prompt far over the context stops after about one piece past the limit instead
# of being encoded whole (seconds and gigabytes for a 15 MB prompt).
PIECE_CHARS = 1 << 16
# Pieces are cut at a space that follows a non-space (a word boundary for byte-level BPE
# pre-tokenizers) when one is near; a cut can still move a few tokens at its edges, so the
# piecewise count refuses only past the limit plus this many tokens per cut.
_CUT_SLACK = 16


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map (the ByteLevel alphabet), inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class _RunCache:
    """LRU of encoded text runs, bounded by characters.

    An agent loop re-sends the same system prompt, tools and history every turn; the text
    between two special tokens encodes the same way every time, so only new turns cost BPE
    work. Ids are stored as ``array('I')`` (4 bytes per id).
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._items: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, text: str) -> array | None:
        with self._lock:
            ids = self._items.get(text)
            if ids is not None:
                self._items.move_to_end(text)
            return ids

    def put(self, text: str, ids: list[int]) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            if text in self._items:
                return
            self._items[text] = array("I", ids)
            self._chars += len(text)
            while self._chars > self.max_chars:
                old, _ = self._items.popitem(last=False)
                self._chars -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._chars = 0


class Tokenizer:
    """Ling's tokenizer; see the module docstring for the encoding rules.

    ``cache_chars`` bounds the run cache (0 disables it); 2M characters hold a long agent
    session's prompt at about 2 MB of ids.
    """

    def __init__(
        self, spec: dict, source: str = "<memory>", *, cache_chars: int = 2_000_000
    ) -> None:
        self._source = source
        self._cache = _RunCache(cache_chars) if cache_chars > 0 else None
        self._check_spec(spec)
        added = spec["added_tokens"] or []
        # TEXT must not produce: every special-flagged added token plus the template markers.
        # They are all flagged special in the one library tokenizer we keep, which is then told
        # not to match special tokens: CONTROL text finds them with our own regex instead.
        forbidden = {
            e["content"] for e in added if e.get("special") or e["content"] in CONTROL_TOKEN_NAMES
        }
        text_spec = dict(spec)
        text_spec["added_tokens"] = [
            {**e, "special": True} if e["content"] in forbidden else e for e in added
        ]
        try:
            self._text = _HFTokenizer.from_str(json.dumps(text_spec))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{source}: tokenizers cannot load it: {exc}") from exc

        self._special_ids: dict[str, int] = {}
        for entry in added:
            name, want = entry["content"], entry["id"]
            got = self._text.token_to_id(name)
            if got != want:
                raise TokenizerError(
                    f"{source}: added token {name!r} declares id {want} but resolves to {got} "
                    "(an added token with a sparse id must also be in model.vocab)"
                )
            self._special_ids[name] = want
        if markers.ROLE_END not in self._special_ids:
            raise TokenizerError(
                f"{source}: no {markers.ROLE_END} added token (Ling's end of turn)"
            )

        self._text.encode_special_tokens = True
        self._forbidden_ids = frozenset(self._special_ids[n] for n in forbidden)

        # CONTROL text is matched against the whole added-token table, longest first.
        names = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names)))

        self._id_bytes = self._build_byte_table(spec)
        self._max_token_bytes = max(len(b) for b in self._id_bytes.values())

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_file(cls, path: str | Path, *, cache_chars: int = 2_000_000) -> Tokenizer:
        p = Path(path)
        try:
            raw = p.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise TokenizerError(f"{p}: tokenizer file not found") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{p}: cannot read tokenizer file: {exc}") from exc
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{p}: not valid JSON: {exc}") from exc
        return cls(spec, source=str(p), cache_chars=cache_chars)

    @staticmethod
    def _check_spec(spec: object) -> None:
        if not isinstance(spec, dict):
            raise TokenizerError("tokenizer.json must be a JSON object")
        model = spec.get("model")
        if not isinstance(model, dict) or model.get("type") != "BPE":
            raise TokenizerError(
                "tokenizer.json: model.type must be 'BPE' (Ling ships byte-level BPE)"
            )
        if not isinstance(model.get("vocab"), dict):
            raise TokenizerError("tokenizer.json: model.vocab missing")
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise TokenizerError(
                f"tokenizer.json: decoder {decoder.get('type')!r} is not supported; "
                "the streaming detokenizer needs a ByteLevel decoder"
            )
        added = spec.get("added_tokens")
        if not (
            isinstance(added, list)
            and all(
                isinstance(e, dict)
                and isinstance(e.get("content"), str)
                and isinstance(e.get("id"), int)
                for e in added
            )
        ):
            raise TokenizerError(
                "tokenizer.json: added_tokens must be a list of {id, content} "
                f"(Ling's special tokens, {markers.ROLE_END} at least)"
            )

    def _build_byte_table(self, spec: dict) -> dict[int, bytes]:
        table = _byte_decoder()
        out: dict[int, bytes] = {}
        for piece, token_id in spec["model"]["vocab"].items():
            try:
                out[token_id] = bytes(table[c] for c in piece)
            except KeyError:
                # Not in the byte alphabet: only added tokens live in the vocab like this.
                out[token_id] = piece.encode("utf-8")
        for name, token_id in self._special_ids.items():
            out[token_id] = name.encode("utf-8")
        return out

    # ---------------------------------------------------------------- properties

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._special_ids)

    def library_json(self) -> str:
        """The ``tokenizers`` JSON this class encodes TEXT with (every control marker flagged
        special), for libraries that read a tokenizer themselves (the grammar masks)."""
        return self._text.to_str()

    @property
    def eos_id(self) -> int:
        return self._special_ids[markers.ROLE_END]

    @property
    def forbidden_ids(self) -> frozenset[int]:
        """Ids TEXT never produces: every special-flagged added token and chat marker."""
        return self._forbidden_ids

    @property
    def turn_ending_ids(self) -> frozenset[int]:
        """Special tokens that end a generated turn: every one but ``markers.ANSWER_MARKERS``.

        A model that writes ``<role>``, ``<tool_response>`` or ``<|endoftext|>`` is writing
        past its own turn (a role header, a tool result it made up, end of text); the turn
        ends there as at ``<|role_end|>``, and the token never reaches the client as text.
        """
        answer = {self._special_ids[n] for n in markers.ANSWER_MARKERS if n in self._special_ids}
        return self._forbidden_ids - answer

    @property
    def max_token_bytes(self) -> int:
        """The longest token's UTF-8 length: a text of N characters (at least N bytes) has
        at least ``N / max_token_bytes`` tokens, a bound known before encoding anything."""
        return self._max_token_bytes

    @property
    def vocab_size(self) -> int:
        """One past the largest id, i.e. the embedding rows a model needs at least."""
        return max(self._id_bytes) + 1

    # ---------------------------------------------------------------- encoding

    def encode_text(self, text: str) -> list[int]:
        """Plain text: special-token spellings become ordinary text tokens."""
        if not text:
            return []
        try:
            # encode_batch runs the Rust work with the GIL released (encode holds it: a
            # 2 MB text stalls every other thread, the server's event loop included, ~1 s).
            ids = self._text.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError as exc:  # the library refuses str with unpaired surrogates
            raise TokenizerError(f"text is not valid Unicode (unpaired surrogate?): {exc}") from exc
        if self._forbidden_ids.intersection(ids):
            # Only possible if BPE merges can build a marker from plain bytes; refusing is the
            # one safe answer (the model would read it as the real marker).
            raise TokenizerError(f"text {text[:60]!r} encodes to a control token id")
        return ids

    def clear_cache(self) -> None:
        if self._cache is not None:
            self._cache.clear()

    def _encode_run(self, text: str, budget: int | None = None,
                    stop: Stop | None = None) -> list[int] | array:
        """One run of ordinary text; with ``budget`` (tokens still allowed) a run that
        cannot fit raises TooManyTokens, found on a cheap bound or after a few pieces."""
        if budget is not None and len(text) > PIECE_CHARS:
            self._check_fits(text, budget, stop)
        cache = self._cache
        if cache is None or not text:
            return self.encode_text(text)
        hit = cache.get(text)
        if hit is not None:
            return hit
        ids = self.encode_text(text)
        cache.put(text, ids)
        return ids

    def _check_fits(self, text: str, budget: int, stop: Stop | None = None) -> None:
        """Raise TooManyTokens when ``text`` cannot encode to ``budget`` tokens or fewer:
        first on its length alone, then counting piece by piece with an early exit."""
        floor = -(-len(text) // self._max_token_bytes)
        if floor > budget:
            raise TooManyTokens(floor)
        counted = cuts = pos = 0
        while pos < len(text):
            if stop is not None and stop():
                raise EncodingStopped
            end = min(pos + PIECE_CHARS, len(text))
            if end < len(text):
                space = text.rfind(" ", pos + PIECE_CHARS // 2, end)
                if space > 0 and not text[space - 1].isspace():
                    end = space
                cuts += 1
            counted += len(self.encode_text(text[pos:end]))
            if counted > budget + _CUT_SLACK * cuts:
                raise TooManyTokens(counted - _CUT_SLACK * cuts)
            pos = end

    def encode_segments(
        self, segments: Iterable[SegmentLike], max_tokens: int | None = None,
        stop: Stop | None = None,
    ) -> list[int]:
        """Typed segments -> ids; only CONTROL text may yield special tokens. With
        ``max_tokens``, a prompt that cannot fit raises TooManyTokens without being encoded
        whole (a 400 for the client at the cost of about ``max_tokens`` tokens of work).
        ``stop`` is asked before each run and each piece of a long one; when it says so,
        EncodingStopped is raised (a server thread whose client left stops there)."""
        ids: list[int] = []
        pending: list[str] = []  # ordinary text since the last special token

        def flush() -> None:
            if stop is not None and stop():
                raise EncodingStopped
            budget = None if max_tokens is None else max_tokens - len(ids)
            ids.extend(self._encode_run("".join(pending), budget, stop))
            pending.clear()
            if max_tokens is not None and len(ids) > max_tokens:
                raise TooManyTokens(len(ids))

        for seg in segments:
            text = seg.text
            if not seg.control:
                pending.append(text)
                continue
            pos = 0
            for m in self._special_re.finditer(text):
                pending.append(text[pos : m.start()])
                flush()
                ids.append(self._special_ids[m.group()])
                pos = m.end()
            pending.append(text[pos:])
        flush()
        return ids

    # ---------------------------------------------------------------- decoding

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._id_bytes[token_id]
        except (KeyError, TypeError):
            raise TokenizerError(f"unknown token id {token_id!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens spelled out, invalid UTF-8 replaced by U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: holds an incomplete UTF-8 sequence until it completes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def finish(self) -> str:
        """Flush: a dangling partial character becomes U+FFFD, exactly as in ``decode``."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

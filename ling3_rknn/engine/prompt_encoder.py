"""Prompt encoding that re-uses the token ids this engine generated.

Byte-level BPE is not unique: the ids the model generated for an answer can differ from a
fresh encoding of the same text (e.g. the model wrote "ab" as "a"+"b" where the merges give
"ab"). The next turn of an agent loop re-renders that answer inside its history; encoded
afresh it would diverge from the cached token path right there and the prefix cache would
miss. So every finished generation is remembered as a transcript (prompt text + generated
text + end-of-turn marker, with the ids the model actually saw), and a new prompt whose
text starts with a remembered transcript gets that transcript's ids, followed by a fresh
encoding of only the rest.

Exactness rules: the prompt part of a transcript must match with the same CONTROL/TEXT
typing (so text that merely spells a marker cannot borrow the ids of a real one); the
generated part is compared as text (it is what the model wrote, special tokens included);
the end-of-turn marker must be CONTROL in the new prompt, and the split happens right
after it, where the tokenizer restarts its encoding anyway (special tokens cut the text
into independently encoded pieces), so ``ids(prefix) + ids(rest) == ids(whole)`` holds for
every part that is encoded afresh.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .api import SegmentLike

Stop = Callable[[], bool]


class SegmentEncoder(Protocol):
    def encode_segments(
        self, segments: Sequence[SegmentLike], max_tokens: int | None = None,
        stop: Stop | None = None,
    ) -> list[int]:
        """With ``max_tokens``: raises (``tokenizer.TooManyTokens``) as soon as the prompt
        is known not to fit, without encoding the rest; with ``stop``: raises
        (``tokenizer.EncodingStopped``) between pieces once it returns True."""
        ...


@dataclass(frozen=True, slots=True)
class Piece:
    """A typed slice of a prompt (satisfies ``SegmentLike``)."""

    text: str
    control: bool


Span = tuple[int, int]


@dataclass(frozen=True)
class TypedText:
    """A prompt's text plus the character ranges the template wrote (CONTROL)."""

    text: str
    control_spans: tuple[Span, ...]

    @classmethod
    def of(cls, segments: Sequence[SegmentLike]) -> TypedText:
        parts: list[str] = []
        spans: list[Span] = []
        pos = 0
        for seg in segments:
            text = seg.text
            if not text:
                continue
            if seg.control:
                if spans and spans[-1][1] == pos:
                    spans[-1] = (spans[-1][0], pos + len(text))
                else:
                    spans.append((pos, pos + len(text)))
            parts.append(text)
            pos += len(text)
        return cls("".join(parts), tuple(spans))

    def spans_before(self, end: int) -> tuple[Span, ...]:
        return tuple((a, min(b, end)) for a, b in self.control_spans if a < end)

    def is_control(self, start: int, end: int) -> bool:
        return any(a <= start and end <= b for a, b in self.control_spans)


@dataclass(frozen=True)
class Transcript:
    """One finished turn: everything the model saw and wrote, as typed text and ids."""

    text: str  # prompt text + generated text + end-of-turn marker
    prompt_chars: int
    prompt_spans: tuple[Span, ...]
    ids: tuple[int, ...]


@dataclass(frozen=True)
class EncodedPrompt:
    ids: list[int]
    typed: TypedText
    spliced_tokens: int  # leading ids taken from a remembered transcript


class PromptEncoder:
    """Encodes prompts, splicing in remembered generated ids where the text matches."""

    def __init__(self, tokenizer: SegmentEncoder, eos_text: str, capacity: int = 64) -> None:
        self._tokenizer = tokenizer
        self._eos_text = eos_text
        self._capacity = capacity
        self._transcripts: OrderedDict[str, Transcript] = OrderedDict()
        self._lock = threading.Lock()

    def encode(
        self, segments: Sequence[SegmentLike], max_tokens: int | None = None,
        stop: Stop | None = None,
    ) -> EncodedPrompt:
        """The prompt's ids; with ``max_tokens`` the tokenizer stops early (and raises)
        once the prompt is known to be longer; ``stop`` ends it between pieces."""
        typed = TypedText.of(segments)
        match = self._best_match(typed)
        if match is None:
            return EncodedPrompt(self._encode(list(segments), max_tokens, stop), typed, 0)
        rest = _segments_after(segments, len(match.text))
        budget = None if max_tokens is None else max_tokens - len(match.ids)
        ids = list(match.ids) + self._encode(rest, budget, stop)
        return EncodedPrompt(ids, typed, len(match.ids))

    def _encode(self, segments: Sequence[SegmentLike], max_tokens: int | None,
                stop: Stop | None) -> list[int]:
        if max_tokens is None and stop is None:
            return self._tokenizer.encode_segments(segments)
        if stop is None:
            return self._tokenizer.encode_segments(segments, max_tokens=max_tokens)
        return self._tokenizer.encode_segments(segments, max_tokens=max_tokens, stop=stop)

    def remember(
        self, prompt: EncodedPrompt, generated_text: str, generated_ids: Sequence[int], eos_id: int
    ) -> Transcript:
        """Record a finished turn whose re-rendering ends with the end-of-turn marker."""
        record = Transcript(
            text=prompt.typed.text + generated_text + self._eos_text,
            prompt_chars=len(prompt.typed.text),
            prompt_spans=prompt.typed.control_spans,
            ids=(*prompt.ids, *generated_ids, eos_id),
        )
        self._add(record)
        return record

    @staticmethod
    def note_of(record: Transcript) -> str:
        """The transcript without its ids (they are the snapshot's token path) as JSON."""
        return json.dumps(
            {
                "transcript": 1,
                "text": record.text,
                "prompt_chars": record.prompt_chars,
                "prompt_spans": [list(s) for s in record.prompt_spans],
            },
            ensure_ascii=False,
        )

    def restore_note(self, note: str, ids: Sequence[int]) -> bool:
        """Re-learn a transcript persisted with a snapshot; False if ``note`` is not one."""
        try:
            data = json.loads(note)
            record = Transcript(
                text=str(data["text"]),
                prompt_chars=int(data["prompt_chars"]),
                prompt_spans=tuple((int(a), int(b)) for a, b in data["prompt_spans"]),
                ids=tuple(int(t) for t in ids),
            )
        except (ValueError, KeyError, TypeError):
            return False
        if data.get("transcript") != 1 or not record.text.endswith(self._eos_text):
            return False
        if not 0 <= record.prompt_chars <= len(record.text) or not record.ids:
            return False
        self._add(record)
        return True

    def _add(self, record: Transcript) -> None:
        with self._lock:
            self._transcripts.pop(record.text, None)
            self._transcripts[record.text] = record
            while len(self._transcripts) > self._capacity:
                self._transcripts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._transcripts)

    def _best_match(self, typed: TypedText) -> Transcript | None:
        with self._lock:
            candidates = list(self._transcripts.values())
        best: Transcript | None = None
        for t in candidates:
            if best is not None and len(t.text) <= len(best.text):
                continue
            if not typed.text.startswith(t.text):
                continue
            if typed.spans_before(t.prompt_chars) != t.prompt_spans:
                continue
            end = len(t.text)
            if not typed.is_control(end - len(self._eos_text), end):
                continue
            best = t
        if best is not None:
            with self._lock:
                if best.text in self._transcripts:
                    self._transcripts.move_to_end(best.text)
        return best


def _segments_after(segments: Sequence[SegmentLike], offset: int) -> list[Piece]:
    """The segments from character ``offset`` on, splitting the one that straddles it."""
    rest: list[Piece] = []
    pos = 0
    for seg in segments:
        text = seg.text
        end = pos + len(text)
        if end > offset:
            cut = max(0, offset - pos)
            rest.append(Piece(text[cut:], seg.control))
        pos = end
    return rest

"""Typed prompt pieces: the unit of the trust boundary between template and content."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SegmentLike(Protocol):
    """What the tokenizer and the engine read of a prompt piece (``Segment`` is one):
    only ``control`` text may become special tokens."""

    @property
    def text(self) -> str: ...

    @property
    def control(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of rendered prompt.

    ``control`` is True only for text the template itself writes (role markers, tags,
    the tools preamble); only such text may be encoded to special tokens. Everything that
    came from a message or a tool definition is ``control=False``.
    """

    text: str
    control: bool


class ChatFormatError(ValueError):
    """A message list or tools list that cannot be rendered; the text names the field."""

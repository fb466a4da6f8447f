"""Stop strings over a stream of text, without ever leaking part of one.

Text that could still turn out to be the start of a stop string is held back until the
next piece of text decides it, so a client never sees "</ans" of a stop "</answer>".
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed decoded text; get back what is safe to emit and whether a stop matched."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Return the text that can be emitted now; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        # The stop that completes first wins (then the longer one), whatever the chunking:
        # the result is the same as if the text arrived one character at a time.
        found = [(i + len(s), i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if found:
            _, start, self.matched = min(found)
            self.stopped = True
            self._held = ""
            return buffer[:start]
        keep = self._held_back_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held-back text at the end of generation (it was not a stop after all)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _held_back_length(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that starts some stop string."""
        for n in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

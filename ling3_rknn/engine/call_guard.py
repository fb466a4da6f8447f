"""Call markup kept out of answers that cannot hold it, and the lazy grammar of ``auto``.

Two per-token constraints with ``TokenConstraint``'s interface (``mask``, ``advance``,
``cut_by_bound``), so the runner drives all three the same way (docs/serving.md 9):

* ``MarkerBan``: tokens that may never be sampled in this answer (with no tools, or under
  ``tool_choice: "none"``, every call marker; before a lazy grammar's trigger, the markers
  that only belong inside a call; the reasoning markers the prompt already spent) or only
  once (the reasoning's close). One cached 0 / -inf row added to the logits row.
* ``LazyCalls``: free text (under a ``MarkerBan``) until the model samples the trigger (the
  call-opening marker); from there on the turn follows the grammar, whose first token is
  that trigger, exactly as a ``required`` turn would after its reasoning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import numpy as np

from .api import InvalidRequest
from .grammar_constraint import TokenConstraint

log = logging.getLogger(__name__)


class BanRows:
    """0 / -inf bias rows, one per set of banned ids and row width, built once: the banned
    sets are a handful of marker sets, so the cache stays tiny."""

    def __init__(self) -> None:
        self._rows: dict[tuple[tuple[int, ...], int], np.ndarray] = {}
        self._lock = threading.Lock()

    def row(self, ids: tuple[int, ...], width: int) -> np.ndarray:
        key = (ids, width)
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                row = np.zeros(width, np.float32)
                row[[i for i in ids if 0 <= i < width]] = -np.inf
                row.setflags(write=False)
                self._rows[key] = row
            return row


class MarkerBan:
    """Never sample ``ids``, and each of ``once`` at most once (the reasoning's closing
    marker, which the generation prompt opened); nothing else changes."""

    cut_by_bound = False

    def __init__(self, rows: BanRows, ids: Iterable[int], once: Iterable[int] = ()) -> None:
        self._rows = rows
        self._ids = tuple(sorted(set(ids)))
        self._once = frozenset(once) - set(self._ids)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with the banned ids at -inf (one add over the row)."""
        if not self._ids:
            return logits
        return logits + self._rows.row(self._ids, logits.shape[0])

    def advance(self, token_id: int) -> list[int]:
        if token_id in self._once:
            self._once -= {token_id}
            self._ids = tuple(sorted({*self._ids, token_id}))
        return []


class LazyCalls:
    """``ban`` until ``trigger`` is sampled, then ``grammar`` (compiled to start with the
    trigger token, which it consumes first). A grammar that breaks while generating (the
    constraint library's limits, reached by what was sampled) leaves the rest of the turn
    free, as it was before this guard, instead of failing a request "auto" used to serve."""

    def __init__(self, grammar: TokenConstraint, trigger: int, ban: MarkerBan) -> None:
        self._grammar = grammar
        self._trigger = trigger
        self._ban = ban
        self.triggered = False
        self.broken = False

    @property
    def cut_by_bound(self) -> bool:
        return self._grammar.cut_by_bound

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if not self.triggered:
            return self._ban.mask(logits)
        if self.broken:
            return logits
        try:
            return self._grammar.mask(logits)
        except InvalidRequest as exc:
            self._break(exc)
            return logits

    def advance(self, token_id: int) -> list[int]:
        if not self.triggered:
            if token_id != self._trigger:
                return self._ban.advance(token_id)
            self.triggered = True
        if self.broken:
            return []
        try:
            return self._grammar.advance(token_id)
        except InvalidRequest as exc:
            self._break(exc)
            return []

    def _break(self, exc: InvalidRequest) -> None:
        self.broken = True
        log.warning("engine: the call grammar broke mid-call; the rest of the turn is free: "
                    "%s", exc)

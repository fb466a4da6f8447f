"""The doctor's findings: one :class:`Check` per fact, printed for people or as JSON.

Each problem carries the exact command that fixes it, so an operator reading the
service log (the unit runs ``doctor --quick`` before starting) knows what to type.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]
_LABEL = {"ok": "ok  ", "warn": "warn", "fail": "FAIL", "skip": "skip"}


@dataclass(frozen=True)
class Check:
    """One finding. ``fail`` makes the board not ready; ``warn`` costs speed, not service."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """All findings of one run; ready when nothing failed."""

    machine: dict[str, Any]
    checks: list[Check] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({"ready": self.ready, "machine": self.machine,
                           "checks": [asdict(c) for c in self.checks]}, indent=1)

    def to_text(self) -> str:
        lines, shown = [], set()
        for c in self.checks:
            lines.append(f"{_LABEL[c.status]} {c.name}: {c.detail}")
            if c.fix and c.status in ("fail", "warn"):
                # a hint shared by several findings (governors.sh) is printed once
                fixes = [f for f in c.fix.splitlines() if f not in shown]
                shown.update(fixes)
                lines.extend(f"     fix: {line}" for line in fixes)
        failed = sum(c.status == "fail" for c in self.checks)
        warned = sum(c.status == "warn" for c in self.checks)
        if not self.ready:
            lines.append(f"not ready: {failed} problem(s), {warned} warning(s)")
        elif self.machine.get("rk3588") is False:
            lines.append("ready (not an RK3588: the checks a host allows passed)")
        else:
            lines.append("ready" + (f" ({warned} warning(s))" if warned else ""))
        return "\n".join(lines)

"""Reads of procfs and sysfs below an injectable root, so tests can build a fake board.

Every path the doctor reads is relative to :class:`SysRoot`'s ``root`` ("/" on a real
machine); fix commands always name the real absolute path (:meth:`SysRoot.shown`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SysRoot:
    """The filesystem root the doctor reads the machine from."""

    root: Path = Path("/")

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    @staticmethod
    def shown(rel: str) -> str:
        """The path as the operator must type it on the board."""
        return "/" + rel.lstrip("/")

    def read(self, rel: str) -> str | None:
        """Stripped text, or None when absent or unreadable (debugfs needs root)."""
        try:
            return self.path(rel).read_text(errors="replace").strip().strip("\x00")
        except OSError:
            return None

    def read_int(self, rel: str) -> int | None:
        text = self.read(rel)
        try:
            return int(text) if text is not None else None
        except ValueError:
            return None

    def glob(self, rel_dir: str, pattern: str) -> list[str]:
        """Relative paths of the entries of ``rel_dir`` matching ``pattern``, sorted."""
        base = self.path(rel_dir)
        try:
            return sorted(f"{rel_dir.rstrip('/')}/{p.name}" for p in base.glob(pattern))
        except OSError:
            return []

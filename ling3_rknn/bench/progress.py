"""A progress bar on stderr while the bench runs.

tqdm comes with the ``convert`` and ``dev`` extras but is not a runtime dependency (the
board install stays small), so without it each step is one plain stderr line instead.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    def __init__(self, total: int, desc: str = "bench") -> None:
        self._bar: Any = None
        self._t0 = time.perf_counter()
        self._done = 0
        self._total = total
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="step", leave=False)

    def step(self, label: str) -> None:
        """Announce the step about to run (and count the one before as done)."""
        if self._bar is not None:
            if self._done:
                self._bar.update(1)
            self._bar.set_postfix_str(label)
        else:
            elapsed = time.perf_counter() - self._t0
            print(f"ling3-rknn bench: [{self._done + 1}/{self._total}] {label} "
                  f"({elapsed:.0f} s)", file=sys.stderr, flush=True)
        self._done += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.close()

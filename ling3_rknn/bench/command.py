"""CLI glue for ``ling3-rknn bench`` (filled in next)."""

from __future__ import annotations

import argparse
import sys


def run_bench(args: argparse.Namespace) -> int:
    print("ling3-rknn bench: not implemented yet", file=sys.stderr)
    return 2

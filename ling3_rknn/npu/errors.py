"""Typed errors of the NPU / CPU executors.

The board runtime reports most failures as a non-zero return code or a ``None`` result
plus a log line; the executors turn every such case into one of these so callers never
have to know RKNNLite's conventions.
"""

from __future__ import annotations


class NpuError(RuntimeError):
    """A graph could not be loaded, initialised or run."""


class NpuInputError(NpuError, ValueError):
    """Inputs do not match what the graph declares (count, shape or dtype)."""


class ExpertError(RuntimeError):
    """The CPU expert executor got inconsistent weights or routing inputs."""

"""Giving freed memory back to the system.

glibc serves mid-sized allocations from its heap once a freed mmap chunk raised its mmap
threshold, and keeps freed heap pages mapped. After a long prompt's prefill scratch (up to
``--prefill-scratch`` bytes) is dropped, the process would keep that peak as resident memory,
which on a board is memory the page cache needs for the memory-mapped routed experts.
``malloc_trim(0)`` returns it. Elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger(__name__)
_libc: Any = None
_looked = False


def _trim_function() -> Any:
    global _libc, _looked
    if not _looked:
        _looked = True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            _libc = libc.malloc_trim if libc is not None else None
        except (OSError, AttributeError):
            _libc = None
    return _libc


def return_freed_memory() -> bool:
    """Hand freed heap pages back to the kernel; True when the C library could."""
    trim = _trim_function()
    if trim is None:
        return False
    return bool(trim(0))

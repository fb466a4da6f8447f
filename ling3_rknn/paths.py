"""Where the runtime keeps what it writes for itself (bundle check stamps), and where the
install put the libraries it compiled for this machine (the decode kernels,
``model/native_build.py``; the NPU matmul stand-in, ``npu/matmul_standin_build.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

KERNEL_DIR_ENV = "LING3_RKNN_KERNEL_DIR"


def kernel_directory() -> Path:
    """Where this install keeps the libraries ``ling3-rknn build-kernels`` compiled:
    ``$LING3_RKNN_KERNEL_DIR``, else ``<sys.prefix>/lib/ling3-rknn`` (not created here)."""
    return Path(os.environ.get(KERNEL_DIR_ENV) or Path(sys.prefix) / "lib" / "ling3-rknn")


def state_directory() -> Path:
    """systemd's ``$STATE_DIRECTORY`` (the unit's ``StateDirectory=``), else
    ``$LING3_RKNN_STATE_DIR``, else ``~/.cache/ling3-rknn``. Not created here."""
    state = (os.environ.get("STATE_DIRECTORY", "").split(":")[0]
             or os.environ.get("LING3_RKNN_STATE_DIR")
             or os.path.join(os.path.expanduser("~"), ".cache", "ling3-rknn"))
    return Path(state)

"""Where the runtime keeps what it writes for itself (bundle check stamps). The decode
kernels are not among them: they are built at install (``model/native_build.py``)."""

from __future__ import annotations

import os
from pathlib import Path


def state_directory() -> Path:
    """systemd's ``$STATE_DIRECTORY`` (the unit's ``StateDirectory=``), else
    ``$LING3_RKNN_STATE_DIR``, else ``~/.cache/ling3-rknn``. Not created here."""
    state = (os.environ.get("STATE_DIRECTORY", "").split(":")[0]
             or os.environ.get("LING3_RKNN_STATE_DIR")
             or os.path.join(os.path.expanduser("~"), ".cache", "ling3-rknn"))
    return Path(state)

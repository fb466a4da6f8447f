"""systemd readiness: ``READY=1`` once the model has loaded (and ``/health`` answers 200),
``STOPPING=1`` when a drain begins, so a ``Type=notify`` unit is "started" exactly when the
service can answer, and ``systemctl start`` waits for it.

The protocol is one datagram on the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (sd_notify(3);
a leading ``@`` is Linux's abstract namespace). Ten lines of the standard library instead of
a binding (systemd-python needs libsystemd headers to build on the board); outside systemd the
variable is unset and every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ling3_rknn.server")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd; False when not run by it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:  # a readiness message must never take the server down
        log.warning("systemd notification %r failed: %s", state, exc)
        return False
    return True

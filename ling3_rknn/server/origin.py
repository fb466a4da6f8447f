"""Host and Origin checks for a server without an API key (docs/serving.md 11).

A keyless server binds to loopback (the CLI refuses anything else), but a web page in the
user's browser can still reach loopback: a cross-origin ``text/plain`` POST needs no CORS
preflight, and DNS rebinding (``evil.example`` re-resolved to 127.0.0.1) lets the page read
the answers too. Local model servers (Ollama's ``OLLAMA_ORIGINS``, Jupyter's
``allow_origin``) refuse such requests by their Host and Origin headers; so does this one:
the Host must name loopback (or an allowed host) and an Origin, when a browser sends one,
must be a loopback origin (or an allowed one). Clients that are not browsers (SDKs, curl,
agents) send no Origin and a loopback Host, and never notice.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from ling3_rknn.server.errors import ApiError


def _loopback_name(host: str) -> bool:
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True  # RFC 6761: resolved to loopback by the client itself, never by DNS
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """``Host`` without its port (``[::1]:8080`` -> ``::1``)."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def _forbidden(what: str, value: str, option: str) -> ApiError:
    return ApiError(403, f"This server has no API key and answers only local clients; the "
                         f"{what} {value[:100]!r} is not allowed (allow it with {option}, or "
                         "serve with an API key).", type="invalid_request_error",
                    code=f"forbidden_{what.lower()}")


def check_host_and_origin(host_header: str | None, origin: str | None,
                          allowed_hosts: tuple[str, ...],
                          allowed_origins: tuple[str, ...]) -> None:
    """Raise a 403 ``ApiError`` for a foreign Host or Origin (keyless servers only)."""
    host = _host_name((host_header or "").strip())
    if not (_loopback_name(host) or host.lower() in {h.lower() for h in allowed_hosts}):
        raise _forbidden("Host", host_header or "", "--allowed-host")
    if origin is None or "*" in allowed_origins:
        return
    if origin.rstrip("/").lower() in {o.rstrip("/").lower() for o in allowed_origins}:
        return
    parts = urlsplit(origin)
    if parts.scheme in ("http", "https") and _loopback_name(parts.hostname or ""):
        return
    raise _forbidden("Origin", origin, "--allowed-origin")

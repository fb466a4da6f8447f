"""The opaque reasoning values that clients hand back next turn: the Responses API's
``encrypted_content`` and the Anthropic ``thinking`` block's ``signature``.

Both exist so that a client which does not keep the reasoning as text (Codex sends
``store: false`` and keeps only the encrypted value; Claude Code asks for thinking with
``display: "omitted"``) can send it back and the server re-renders the assistant turn byte
for byte, which is what makes the next turn hit the prefix cache (docs/serving.md 10.3).
The value is the reasoning text itself, base64url-encoded, with a SHA-256 check: not a
secret (the client may read its own model's reasoning), but a value this server did not
write, or one altered on the way, is refused by name instead of silently rendering a
different prompt.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

PREFIX = "ling3r1"
_DOMAIN = b"ling3-rknn reasoning v1\0"


def _digest(text: str) -> str:
    raw = hashlib.sha256(_DOMAIN + text.encode("utf-8", "surrogatepass")).digest()[:16]
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def seal(text: str) -> str:
    """``encrypted_content`` for ``text``: the text and its check in one opaque string."""
    body = base64.urlsafe_b64encode(text.encode("utf-8", "surrogatepass")).decode()
    return f"{PREFIX}.{body}.{_digest(text)}"


def unseal(value: str) -> str | None:
    """The text ``seal`` put in ``value``; None when ``value`` is not one of ours or was
    altered."""
    prefix, _, rest = value.partition(".")
    body, _, digest = rest.rpartition(".")
    if prefix != PREFIX or not body:
        return None
    try:
        text = base64.urlsafe_b64decode(body.encode("ascii")).decode("utf-8", "surrogatepass")
    except (binascii.Error, ValueError):
        return None
    return text if hmac.compare_digest(_digest(text), digest) else None


def is_sealed(value: str) -> bool:
    """Whether ``value`` claims to be one of ours (as opposed to another server's)."""
    return value.startswith(PREFIX + ".")

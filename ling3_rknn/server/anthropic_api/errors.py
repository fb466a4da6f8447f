"""Errors in the Anthropic shape: ``{"type": "error", "error": {"type", "message"}}`` with
the status codes Anthropic's clients act on. The queue's 503s (busy, loading, draining)
become 529 ``overloaded_error``, which the Anthropic SDKs and Claude Code retry with
backoff; a prompt over the context limit says "prompt is too long: N tokens > M maximum",
the text Claude Code compacts on (docs/serving.md 10.5)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ling3_rknn.server.errors import ApiError

OVERLOADED = 529
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          429: "rate_limit_error", OVERLOADED: "overloaded_error", 504: "timeout_error"}


def status_of(error: ApiError) -> int:
    return OVERLOADED if error.status == 503 else error.status


def error_body(error: ApiError) -> dict[str, Any]:
    status = status_of(error)
    message = error.message
    if error.code == "context_length_exceeded" and error.details:
        # Exactly Anthropic's wording: Claude Code matches it (also anchored) to compact.
        message = (f"prompt is too long: {error.details['prompt_tokens']} tokens > "
                   f"{error.details['max_context']} maximum")
    elif error.param and error.status == 400 and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: ApiError, request_id: str | None) -> web.Response:
    headers = dict(error.headers)
    headers.pop("WWW-Authenticate", None)
    if request_id:
        headers["X-Request-Id"] = headers["request-id"] = request_id
    return web.Response(status=status_of(error), body=json.dumps(error_body(error)).encode(),
                        content_type="application/json", headers=headers)

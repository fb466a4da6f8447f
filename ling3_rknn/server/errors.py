"""Errors in OpenAI's body shape, so every client's error handling (retries, context
compaction, messages shown to the user) works against this server unchanged."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

# Error text quotes what the client sent (a value, a key, a model name); a 1 MB value must
# not come back whole in the answer and in the log. Longer text keeps its head and tail.
MESSAGE_CHARS = 2000
PARAM_CHARS = 300


def cut(text: str, limit: int) -> str:
    """``text`` if it is at most ``limit`` characters, else its head and tail around a
    note of how much was left out."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]}...[{len(text) - head - tail} characters cut]...{text[-tail:]}"


def shown(value: object, limit: int = 120) -> str:
    """A client value quoted in an error message (its repr, cut to ``limit``)."""
    return cut(repr(value), limit)


class ApiError(Exception):
    """An error that becomes ``{"error": {"message", "type", "param", "code"}}``; message
    and param are cut to ``MESSAGE_CHARS`` and ``PARAM_CHARS``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        message = cut(message, MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else cut(param, PARAM_CHARS)
        self.code = code
        self.headers = dict(headers or {})
        # Facts another wire format words differently (e.g. the token counts of a prompt
        # that is too long, which Anthropic clients parse from their own message).
        self.details = dict(details or {})

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        return web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
            headers=headers,
        )


def error_kind(error: ApiError) -> str:
    """Who an error is about, for /metrics: ``client`` (the request was wrong, 4xx),
    ``device`` (the model or NPU failed), ``unavailable`` (busy, loading, shutting down)
    or ``internal`` (a bug)."""
    if error.code == "engine_failure":
        return "device"
    if error.status == 503:
        return "unavailable"
    if error.status >= 500:
        return "internal"
    return "client"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def context_length_exceeded(message: str, prompt_tokens: int | None = None,
                            max_context: int | None = None) -> ApiError:
    # opencode and pi trigger compaction on this code or on "maximum context length is N tokens".
    details = {} if prompt_tokens is None else {"prompt_tokens": prompt_tokens,
                                                "max_context": max_context}
    return ApiError(400, message, param="messages", code="context_length_exceeded",
                    details=details)


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def not_found(message: str, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, type="invalid_request_error", param=param, code=code)


def busy(message: str, retry_after_s: int = 1) -> ApiError:
    # The OpenAI SDKs and the AI SDK retry 503 honouring Retry-After.
    return ApiError(
        503,
        message,
        type="server_busy",
        code="server_busy",
        headers={"Retry-After": str(retry_after_s)},
    )


def loading() -> ApiError:
    return ApiError(
        503,
        "The model is still loading; retry shortly.",
        type="server_busy",
        code="model_loading",
        headers={"Retry-After": "5"},
    )


def internal(request_id: str | None) -> ApiError:
    # Never a traceback in the body; the request id links the client's report to the log.
    suffix = f" (request id {request_id})" if request_id else ""
    return ApiError(
        500,
        f"The server had an internal error while processing the request{suffix}.",
        type="server_error",
        code="internal_error",
        headers={"x-should-retry": "false"},
    )


def from_http_exception(exc: web.HTTPException) -> ApiError:
    """Map aiohttp's own errors (404 route, 405 method, 413 body) to OpenAI bodies."""
    status = exc.status
    if status == 404:
        return not_found("Unknown route.", code="unknown_route")
    if status == 405:
        return ApiError(405, "Method not allowed for this route.", code="method_not_allowed")
    if status == 413:
        return ApiError(413, "Request body too large.", code="request_too_large")
    return ApiError(status, exc.reason or "HTTP error", code=None)


def shutdown() -> ApiError:
    """The service is stopping: retry (elsewhere, or once it is back)."""
    return ApiError(503, "The server is shutting down; retry the request.",
                    type="server_error", code="shutdown", headers={"Retry-After": "5"})

"""OpenAI response and chunk shapes (docs/serving.md 6.4 and 6.5), built as
plain dicts so the hot streaming path is one ``json.dumps`` per chunk."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ling3_rknn.chat import openai_tool_call
from ling3_rknn.chat.events import ToolCallParsed, Usage
from ling3_rknn.server.sse import encode_event


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": min(usage.reasoning_tokens, usage.completion_tokens)
        },
    }


@dataclass
class MessageBuilder:
    """Accumulates completion events into one non-stream ``chat.completion`` body."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallParsed] = field(default_factory=list)

    def body(
        self,
        completion_id: str,
        model: str,
        created: int,
        finish_reason: str,
        usage: Usage,
    ) -> dict[str, Any]:
        text = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not self.tool_calls else None,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [openai_tool_call(c.call) for c in self.tool_calls]
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            ],
            "usage": usage_body(usage),
        }


class ChunkFactory:
    """Chunks of one stream: same id, created and model on every chunk."""

    def __init__(self, completion_id: str, model: str, include_usage: bool) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        # Text deltas are the hot path (one per token): the frame around the delta is
        # encoded once, so each token costs one json.dumps of its text only. The bytes are
        # identical to encode_event(self._chunk(delta)) (tested).
        marker = {"__delta__": 0}
        head, tail = encode_event(self._chunk(marker)).split(json.dumps(marker).encode())
        self._head, self._tail = head, tail

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": None})

    def reasoning(self, text: str) -> dict[str, Any]:
        return self._chunk({"reasoning_content": text})

    def content(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text})

    def reasoning_event(self, text: str) -> bytes:
        return self._text_event(b"reasoning_content", text)

    def content_event(self, text: str) -> bytes:
        return self._text_event(b"content", text)

    def _text_event(self, field: bytes, text: str) -> bytes:
        value = json.dumps(text, ensure_ascii=False).encode()
        return b"".join((self._head, b'{"', field, b'": ', value, b"}", self._tail))

    def tool_call(self, event: ToolCallParsed) -> dict[str, Any]:
        return self._chunk({"tool_calls": [{"index": event.index, **openai_tool_call(event.call)}]})

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({}, finish_reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [],
            "usage": usage_body(usage),
        }


def models_body(model_ids: list[str], created: int, max_context: int | None) -> dict[str, Any]:
    """The model list in a form both API families' clients read: OpenAI's keys (``object``,
    ``created``, ``owned_by``) and Anthropic's (``type``, ``display_name``, ``created_at``,
    ``has_more``, ``first_id``, ``last_id``) side by side; each ignores the other's."""
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    data = []
    for model_id in model_ids:
        entry: dict[str, Any] = {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "ling3-rknn",
            "type": "model",
            "display_name": model_id,
            "created_at": created_at,
        }
        if max_context:
            entry["max_model_len"] = max_context
        data.append(entry)
    return {"object": "list", "data": data, "has_more": False,
            "first_id": model_ids[0] if model_ids else None,
            "last_id": model_ids[-1] if model_ids else None}

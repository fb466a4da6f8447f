"""``POST /v1/chat/completions`` as a front end of the shared generation flow
(``generation_route``): its reader is the strict chat schema (``validate``), its writer
turns completion events into ``chat.completion`` bodies and chunks (``responses``)."""

from __future__ import annotations

import time
from typing import Any

from ling3_rknn.chat.events import ContentDelta, Finished, ReasoningDelta, ToolCallParsed
from ling3_rknn.server.completion import CompletionEvent
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.generation_route import WireApi, route
from ling3_rknn.server.responses import ChunkFactory, MessageBuilder, new_completion_id
from ling3_rknn.server.sse import DONE, encode_event
from ling3_rknn.server.validate import ChatRequest, parse_chat_request


class ChatWriter:
    """Completion events -> OpenAI chat completion (whole) or chunks (stream)."""

    def __init__(self, request: ChatRequest, model: str, stream: bool) -> None:
        self._stream = stream
        self._model = model
        self._id = new_completion_id()
        self._chunks = ChunkFactory(self._id, model, request.include_usage) if stream else None
        self._message = MessageBuilder()

    def opening(self, prompt_tokens: int) -> bytes:
        assert self._chunks is not None
        return encode_event(self._chunks.role())

    def event(self, event: CompletionEvent) -> bytes:
        chunks = self._chunks
        if isinstance(event, ContentDelta):
            if chunks is None:
                self._message.content.append(event.text)
                return b""
            return chunks.content_event(event.text)
        if isinstance(event, ReasoningDelta):
            if chunks is None:
                self._message.reasoning.append(event.text)
                return b""
            return chunks.reasoning_event(event.text)
        if isinstance(event, ToolCallParsed):
            if chunks is None:
                self._message.tool_calls.append(event)
                return b""
            return encode_event(chunks.tool_call(event))
        return b""

    def finish(self, done: Finished) -> bytes:
        chunks = self._chunks
        assert chunks is not None
        parts = [encode_event(chunks.finish(done.finish_reason))]
        if chunks.include_usage:
            parts.append(encode_event(chunks.usage(done.usage)))
        parts.append(DONE)
        return b"".join(parts)

    def body(self, done: Finished) -> dict[str, Any]:
        return self._message.body(self._id, self._model, int(time.time()), done.finish_reason,
                                  done.usage)

    def error_event(self, error: ApiError) -> bytes:
        return encode_event(error.body())


def _read(body: dict[str, Any]) -> tuple[ChatRequest, None]:
    return parse_chat_request(body), None


CHAT_API = WireApi(
    name="chat",
    read=_read,
    writer=lambda request, _notes, model, stream: ChatWriter(request, model, stream),
)
chat_completions = route(CHAT_API)

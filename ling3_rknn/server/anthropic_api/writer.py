"""Completion events -> the Anthropic Messages API: the whole ``message``, or its event
stream (``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``).

Content blocks follow the order the model writes: ``thinking`` (its signature is the text
sealed by ``reasoning_seal``, so it comes back next turn even when the client asked for
``display: "omitted"`` and got no text), ``text``, then one ``tool_use`` per call. Usage
follows Anthropic's split: ``input_tokens`` are the prompt tokens evaluated,
``cache_read_input_tokens`` those the prefix cache supplied (their sum is the prompt);
streams give the final figures in ``message_delta`` (docs/serving.md 10.4).
"""

from __future__ import annotations

import secrets
from typing import Any

from ling3_rknn.chat.events import ContentDelta, Finished, ReasoningDelta, ToolCallParsed, Usage
from ling3_rknn.server import reasoning_seal
from ling3_rknn.server.anthropic_api.errors import error_body
from ling3_rknn.server.anthropic_api.reader import MessagesNotes
from ling3_rknn.server.completion import CompletionEvent
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.sse import encode_named_event


def usage_body(usage: Usage | None) -> dict[str, Any]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0}
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return encode_named_event(name, {"type": name, **payload})


class MessagesWriter:
    def __init__(self, notes: MessagesNotes, model: str, stream: bool) -> None:
        self._notes = notes
        self._stream = stream
        self._message: dict[str, Any] = {
            "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_body(None),
        }
        self._block: dict[str, Any] | None = None  # the open thinking or text block
        self._parts: list[str] = []

    def opening(self, prompt_tokens: int) -> bytes:
        # The prompt's size is known at admission, its cache hit only at the end: until
        # message_delta all of it counts as input (the sum Anthropic's clients add up).
        usage = dict(self._message["usage"], input_tokens=prompt_tokens)
        return (_event("message_start", {"message": dict(self._message, content=[],
                                                         usage=usage)})
                + _event("ping", {}))

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._block, self._parts = block, []
        self._message["content"].append(block)
        if not self._stream:
            return out
        return out + _event("content_block_start", {"index": self._index(),
                                                    "content_block": dict(block)})

    def _index(self) -> int:
        return len(self._message["content"]) - 1

    def _close(self) -> bytes:
        block = self._block
        if block is None:
            return b""
        self._block = None
        text = "".join(self._parts)
        out = b""
        if block["type"] == "thinking":
            block["thinking"] = text if self._notes.show_thinking else ""
            block["signature"] = reasoning_seal.seal(text)
            if self._stream:
                out += _event("content_block_delta", {"index": self._index(), "delta": {
                    "type": "signature_delta", "signature": block["signature"]}})
        else:
            block["text"] = text
        if self._stream:
            out += _event("content_block_stop", {"index": self._index()})
        return out

    def event(self, event: CompletionEvent) -> bytes:
        if isinstance(event, ReasoningDelta):
            out = b""
            if self._block is None or self._block["type"] != "thinking":
                out = self._open({"type": "thinking", "thinking": "", "signature": ""})
            if not self._notes.show_thinking:
                self._parts.append(event.text)
                return out
            return out + self._delta({"type": "thinking_delta", "thinking": event.text},
                                     event.text)
        if isinstance(event, ContentDelta):
            out = b""
            if self._block is None or self._block["type"] != "text":
                out = self._open({"type": "text", "text": ""})
            return out + self._delta({"type": "text_delta", "text": event.text}, event.text)
        if isinstance(event, ToolCallParsed):
            return self._tool_use(event)
        return b""

    def _delta(self, delta: dict[str, Any], text: str) -> bytes:
        self._parts.append(text)
        if not self._stream:
            return b""
        return _event("content_block_delta", {"index": self._index(), "delta": delta})

    def _tool_use(self, event: ToolCallParsed) -> bytes:
        out = self._close()
        call = event.call
        arguments = call.arguments if isinstance(call.arguments, dict) else {}
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}
        self._message["content"].append(block)
        if not self._stream:
            return out
        index = self._index()
        out += _event("content_block_start", {"index": index, "content_block": dict(
            block, input={})})
        out += _event("content_block_delta", {"index": index, "delta": {
            "type": "input_json_delta", "partial_json": call.arguments_json()}})
        return out + _event("content_block_stop", {"index": index})

    def _settle(self, done: Finished) -> bytes:
        out = self._close()
        reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(done.finish_reason,
                                                                        "end_turn")
        if reason == "end_turn" and done.stop in self._notes.stop_sequences:
            reason = "stop_sequence"
            self._message["stop_sequence"] = done.stop
        self._message["stop_reason"] = reason
        self._message["usage"] = usage_body(done.usage)
        return out

    def finish(self, done: Finished) -> bytes:
        out = self._settle(done)
        delta = {"stop_reason": self._message["stop_reason"],
                 "stop_sequence": self._message["stop_sequence"]}
        out += _event("message_delta", {"delta": delta, "usage": self._message["usage"]})
        return out + _event("message_stop", {})

    def body(self, done: Finished) -> dict[str, Any]:
        self._settle(done)
        return self._message

    def error_event(self, error: ApiError) -> bytes:
        return encode_named_event("error", error_body(error))

"""Completion events -> the Responses API: the whole ``response`` object, or its event
stream (``response.created`` ... ``response.completed``) with ``sequence_number``s.

The output items follow the order the model writes: a ``reasoning`` item (its text as the
one ``summary_text``, and with ``include: ["reasoning.encrypted_content"]`` that text
sealed so the client can send it back, ``reasoning_seal``), a ``message`` with one
``output_text`` part, then one ``function_call`` item per call. Streamed and whole answers
are built from the same items, so they always agree (docs/serving.md 10.2).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from ling3_rknn.chat.events import ContentDelta, Finished, ReasoningDelta, ToolCallParsed, Usage
from ling3_rknn.server import reasoning_seal
from ling3_rknn.server.completion import CompletionEvent
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.responses_api.reader import ResponsesNotes
from ling3_rknn.server.sse import encode_named_event


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # The engine snapshots the end of every prompt, so what it evaluated was written.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                 "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": min(usage.reasoning_tokens, usage.completion_tokens)},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponsesWriter:
    """One response; ``stream`` says whether event bytes are built at all."""

    def __init__(self, notes: ResponsesNotes, model: str, stream: bool) -> None:
        self._notes = notes
        self._stream = stream
        self._response: dict[str, Any] = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "model": model, "output": [],
            "previous_response_id": None, "truncation": "disabled", "usage": None,
            **notes.echo,
        }
        if self._response.get("metadata") is None:
            self._response["metadata"] = {}
        self._seq = 0
        self._item: dict[str, Any] | None = None  # the open reasoning or message item
        self._parts: list[str] = []  # its text so far
        self._tail = b""  # the last item's closing events, once settled

    # -- stream framing --------------------------------------------------------------

    def _event(self, event_type: str, /, **payload: Any) -> bytes:
        data = {"type": event_type, "sequence_number": self._seq, **payload}
        self._seq += 1
        return encode_named_event(event_type, data)

    def _snapshot(self) -> dict[str, Any]:
        return dict(self._response, output=list(self._response["output"]))

    def opening(self, prompt_tokens: int) -> bytes:
        return (self._event("response.created", response=self._snapshot())
                + self._event("response.in_progress", response=self._snapshot()))

    # -- items -----------------------------------------------------------------------

    def _open(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self._item, self._parts = item, []
        self._response["output"].append(item)
        if not self._stream:
            return out
        index = len(self._response["output"]) - 1
        out += self._event("response.output_item.added", output_index=index, item=dict(item))
        if item["type"] == "reasoning":
            out += self._event("response.reasoning_summary_part.added", item_id=item["id"],
                               output_index=index, summary_index=0,
                               part={"type": "summary_text", "text": ""})
        else:
            out += self._event("response.content_part.added", item_id=item["id"],
                               output_index=index, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})
        return out

    def _close(self, status: str = "completed") -> bytes:
        item = self._item
        if item is None:
            return b""
        self._item = None
        text = "".join(self._parts)
        index = len(self._response["output"]) - 1
        out = b""
        part: dict[str, Any]
        if item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            if self._notes.encrypted_reasoning:
                item["encrypted_content"] = reasoning_seal.seal(text)
            if self._stream:
                out += self._event("response.reasoning_summary_text.done", item_id=item["id"],
                                   output_index=index, summary_index=0, text=text)
                out += self._event("response.reasoning_summary_part.done", item_id=item["id"],
                                   output_index=index, summary_index=0, part=part)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            item["status"] = status
            if self._stream:
                out += self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=text,
                                   logprobs=[])
                out += self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part)
        if self._stream:
            out += self._event("response.output_item.done", output_index=index, item=item)
        return out

    def event(self, event: CompletionEvent) -> bytes:
        if isinstance(event, ReasoningDelta):
            out = b""
            if self._item is None or self._item["type"] != "reasoning":
                out = self._open({"id": _id("rs"), "type": "reasoning", "summary": []})
            return out + self._delta(event.text, "response.reasoning_summary_text.delta",
                                     summary_index=0)
        if isinstance(event, ContentDelta):
            out = b""
            if self._item is None or self._item["type"] != "message":
                out = self._open({"id": _id("msg"), "type": "message", "status": "in_progress",
                                  "role": "assistant", "content": []})
            return out + self._delta(event.text, "response.output_text.delta",
                                     content_index=0, logprobs=[])
        if isinstance(event, ToolCallParsed):
            return self._call(event)
        return b""

    def _delta(self, text: str, name: str, **where: Any) -> bytes:
        self._parts.append(text)
        if not self._stream:
            return b""
        assert self._item is not None
        return self._event(name, item_id=self._item["id"],
                           output_index=len(self._response["output"]) - 1, delta=text, **where)

    def _call(self, event: ToolCallParsed) -> bytes:
        out = self._close()
        call = event.call
        arguments = call.arguments_json()
        item: dict[str, Any] = {"id": _id("fc"), "type": "function_call", "status": "completed",
                                "call_id": call.id, "name": call.name, "arguments": arguments}
        split = self._notes.tools.namespaces.get(call.name)
        if split is not None:
            item["namespace"], item["name"] = split
        self._response["output"].append(item)
        if not self._stream:
            return out
        index = len(self._response["output"]) - 1
        opened = dict(item, status="in_progress", arguments="")
        out += self._event("response.output_item.added", output_index=index, item=opened)
        out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=arguments)
        out += self._event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, name=item["name"], arguments=arguments)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    # -- the end ---------------------------------------------------------------------

    def _settle(self, done: Finished) -> str:
        """Close the last item and fill in status and usage; returns the final event name."""
        incomplete = done.finish_reason == "length"
        out = self._close("incomplete" if incomplete else "completed")
        self._tail = out
        self._response["usage"] = usage_body(done.usage)
        if incomplete:
            self._response["status"] = "incomplete"
            self._response["incomplete_details"] = {"reason": "max_output_tokens"}
            return "response.incomplete"
        self._response["status"] = "completed"
        return "response.completed"

    def finish(self, done: Finished) -> bytes:
        name = self._settle(done)
        return self._tail + self._event(name, response=self._response)

    def body(self, done: Finished) -> dict[str, Any]:
        self._settle(done)
        return self._response

    def error_event(self, error: ApiError) -> bytes:
        """``response.failed`` with the error, as the spec ends a stream that failed."""
        out = self._close("incomplete")
        self._response["status"] = "failed"
        code = error.code if error.status < 500 else "server_error"
        self._response["error"] = {"code": code or "server_error", "message": error.message}
        return out + self._event("response.failed", response=self._response)

"""``POST /v1/messages/count_tokens``: the prompt a Messages request would render, counted
with the engine's own encoder (generated-id splices included, so the count is what the
engine would evaluate or restore), through the shared counting flow (``count_route``):
bounded like a generation's admission, off the event loop, in its share of the threads."""

from __future__ import annotations

from typing import Any

from ling3_rknn.server.anthropic_api.reader import read_messages_request
from ling3_rknn.server.count_route import CountApi, route
from ling3_rknn.server.validate import ChatRequest


def _read(body: dict[str, Any]) -> ChatRequest:
    return read_messages_request(body, count_only=True)[0]


COUNT_TOKENS_API = CountApi(
    name="count_tokens",
    read=_read,
    answer=lambda tokens: {"input_tokens": tokens},
)
count_tokens = route(COUNT_TOKENS_API)

"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages
API as a front end of the shared generation flow (reader: ``reader``; writer: ``writer``;
errors: ``errors``). Claude Code and pi's ``anthropic-messages`` provider speak only this
API."""

from __future__ import annotations

from ling3_rknn.server.anthropic_api.count_tokens import count_tokens
from ling3_rknn.server.anthropic_api.errors import error_response
from ling3_rknn.server.anthropic_api.reader import read_messages_request
from ling3_rknn.server.anthropic_api.writer import MessagesWriter
from ling3_rknn.server.generation_route import WireApi, route

MESSAGES_API = WireApi(
    name="messages",
    read=read_messages_request,
    writer=lambda _request, notes, model, stream: MessagesWriter(notes, model, stream),
)
messages_route = route(MESSAGES_API)

__all__ = ["MESSAGES_API", "count_tokens", "error_response", "messages_route"]

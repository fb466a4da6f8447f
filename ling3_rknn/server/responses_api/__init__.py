"""``POST /v1/responses``: OpenAI's Responses API as a front end of the shared generation
flow (reader: ``reader`` + ``items`` + ``tools``; writer: ``writer``). Codex CLI, the OpenAI
Agents SDK's default model and the AI SDK's default OpenAI provider speak only this API."""

from __future__ import annotations

from ling3_rknn.server.generation_route import WireApi, route
from ling3_rknn.server.responses_api.reader import read_responses_request
from ling3_rknn.server.responses_api.writer import ResponsesWriter

RESPONSES_API = WireApi(
    name="responses",
    read=read_responses_request,
    writer=lambda _request, notes, model, stream: ResponsesWriter(notes, model, stream),
)
responses_route = route(RESPONSES_API)

__all__ = ["RESPONSES_API", "responses_route"]

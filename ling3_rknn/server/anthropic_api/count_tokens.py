"""``POST /v1/messages/count_tokens``: the prompt a Messages request would render, counted
with the engine's own encoder (generated-id splices included, so the count is what the
engine would evaluate or restore). Parsing, rendering and encoding run off the event loop;
their cost is bounded by ``--max-body-bytes``."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ling3_rknn.server.anthropic_api.reader import read_messages_request
from ling3_rknn.server.completion import render_prompt
from ling3_rknn.server.generation_route import check_model, parse_json, served_models
from ling3_rknn.server.state import ENGINE


async def count_tokens(request: web.Request) -> web.Response:
    engine = request.app[ENGINE].require()
    raw = await request.read()
    models = served_models(request)

    def count() -> int:  # parsing, rendering and encoding: off the event loop
        chat_request, _ = read_messages_request(parse_json(raw), count_only=True)
        check_model(chat_request.model, models)
        return len(engine.encode_prompt(render_prompt(chat_request)))

    return web.json_response({"input_tokens": await asyncio.to_thread(count)})

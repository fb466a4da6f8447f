"""The one handler flow of every route that counts a prompt's tokens without generating
(``POST /v1/messages/count_tokens`` today): the same body reader, renderer and bounded
encoding as the generation routes, in the counting share of the worker threads.

A count is as much work as a generation's admission, so it gets the same bounds
(docs/serving.md 11): the body limit, a prompt over the context refused with the
generation routes' 400 before it is encoded whole (``Engine.count_prompt``), encoding off
the event loop and stopped once the client leaves, and at most ``WorkerShare.size``
counts holding a thread at once, so counting never starves generation of threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ling3_rknn.engine.api import SegmentLike
from ling3_rknn.server import errors
from ling3_rknn.server.completion import engine_errors, render_prompt
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.generation_route import check_model, parse_json, served_models
from ling3_rknn.server.param_names import renamed
from ling3_rknn.server.state import COUNTING, ENGINE, RID, STATE
from ling3_rknn.server.validate import ChatRequest


@dataclass(frozen=True)
class CountApi:
    """A counting route: ``read`` checks a JSON body (as its generation route's reader
    does, less what only generation needs), ``answer`` words the count."""

    name: str
    read: Callable[[dict[str, Any]], ChatRequest]
    answer: Callable[[int], dict[str, Any]]


def _prepare(api: CountApi, raw: bytes, models: tuple[str, ...]) -> Sequence[SegmentLike]:
    """Body to prompt segments: parsing, the reader's checks and rendering, whose cost
    grows with the body (a worker thread's job, never the event loop's)."""
    chat_request = api.read(parse_json(raw))
    try:
        check_model(chat_request.model, models)
        return render_prompt(chat_request)
    except ApiError as exc:
        raise renamed(chat_request.names, exc) from None


def route(api: CountApi) -> Callable[[web.Request], Any]:
    """The aiohttp handler of ``api``."""

    async def handle(request: web.Request) -> web.Response:
        return await serve(request, api)

    handle.__name__ = f"{api.name}_route"
    return handle


async def serve(request: web.Request, api: CountApi) -> web.Response:
    app = request.app
    if app[STATE].get("stopping"):
        raise errors.shutdown()
    engine = app[ENGINE].require()
    raw = await request.read()
    share = app[COUNTING]
    segments = await share.run(_prepare, api, raw, served_models(request))
    async with share.slot():
        with engine_errors("The engine could not count the prompt.", request[RID]):
            tokens = await engine.count_prompt(segments)
    return web.json_response(api.answer(tokens))

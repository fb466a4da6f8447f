"""One chat completion from a validated request to typed events.

Streaming and non-streaming responses both consume the same event sequence (the token
stream's one vocabulary, ``chat.events``), so a streamed answer always concatenates to the
non-streamed one. Rendering (OpenAI messages to typed prompt segments) and parsing
(generated text to reasoning, content and tool calls) belong to ``ling3_rknn.chat``; the
engine runs the request's parser as it decodes, and this module only wires the request
to the engine, gives each call its id and settles the finish reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ling3_rknn import chat
from ling3_rknn.chat import markers
from ling3_rknn.chat.events import (
    Admitted,
    ContentDelta,
    Finished,
    GenerationEvent,
    ReasoningDelta,
    ToolCallParsed,
)
from ling3_rknn.engine.api import (
    ContextLengthExceeded,
    EngineBusy,
    EngineFailure,
    EngineProtocol,
    EngineShutDown,
    GenerationRequest,
    InvalidRequest,
    SegmentLike,
)
from ling3_rknn.server.errors import (
    ApiError,
    busy,
    context_length_exceeded,
    invalid_request,
    shutdown,
)
from ling3_rknn.server.validate import ChatRequest

log = logging.getLogger("ling3_rknn.server")

# The model sometimes spells its end-of-turn marker as ordinary text tokens instead of the
# control token; treating the text as a stop string ends the turn either way.
END_OF_TURN_TEXT = markers.ROLE_END

# What a completion yields: the engine's parsed events, each call with its id, then the
# engine's Finished with the OpenAI finish reason ("tool_calls" when the turn made calls).
CompletionEvent = ReasoningDelta | ContentDelta | ToolCallParsed | Finished


def engine_failure(exc: EngineFailure, request_id: str) -> ApiError:
    """The model or NPU failed; the engine stays usable, so a retry may succeed. The
    client gets no internal exception text (it may name files or memory addresses); the
    log has it. A closed engine is the service stopping, not a failure."""
    if isinstance(exc, EngineShutDown):
        return shutdown()
    log.error("%s engine failure: %s", request_id, exc)
    return ApiError(500, "The model failed while generating this answer; the server is "
                         "still up and the request can be retried.",
                    type="server_error", code="engine_failure")


def render_prompt(request: ChatRequest) -> Sequence[SegmentLike]:
    """Typed prompt segments; bad history (e.g. a tool message without a call) is a 400."""
    try:
        return chat.render(
            request.messages,
            request.tools,
            enable_thinking=request.enable_thinking,
            add_generation_prompt=True,
        )
    except chat.ChatFormatError as exc:
        raise invalid_request(str(exc), param="messages") from None


def callable_tools(request: ChatRequest) -> Any:
    """The tools the model's output may call (none under ``tool_choice: none``; the
    ``allowed_tools`` subset where one is given)."""
    if request.tool_choice == "none" or not request.tools:
        return None
    if request.allowed_tools is None:
        return request.tools
    return [t for t in request.tools if t["function"]["name"] in request.allowed_tools]


def turn_grammar(request: ChatRequest) -> chat.TurnGrammar | None:
    """The grammar a constrained request's answer must follow (docs/serving.md section 9);
    a shape it cannot express is a 400 naming the request part."""
    try:
        return chat.turn_grammar(
            request.tools,
            tool_choice=request.tool_choice,  # type: ignore[arg-type]
            forced_tool=request.forced_tool,
            parallel_tool_calls=request.parallel_tool_calls,
            thinking=request.enable_thinking,
            response_schema=request.response_schema,
            allowed_tools=request.allowed_tools,
        )
    except chat.GrammarError as exc:
        raise invalid_request(str(exc), param=exc.part) from None


def banned_markers(request: ChatRequest, grammar: chat.TurnGrammar | None) -> tuple[str, ...]:
    """Markers the answer may not sample (docs/serving.md 9): every call marker where no
    call is possible (no tools, ``tool_choice: "none"``), the ones that only belong inside
    a call before a lazy grammar's trigger, and the reasoning markers the generation prompt
    already spent; a full grammar needs none."""
    if grammar is not None and grammar.trigger is None:
        return ()
    spent, _ = markers.spent_reasoning_markers(request.enable_thinking)
    if grammar is not None:
        return (*markers.CALL_BODY_MARKERS, *spent)
    return (*(markers.CALL_MARKERS if callable_tools(request) is None else ()), *spent)


def once_markers(request: ChatRequest, grammar: chat.TurnGrammar | None) -> tuple[str, ...]:
    """Markers the answer may sample at most once: the reasoning's close, thinking on."""
    if grammar is not None and grammar.trigger is None:
        return ()
    return markers.spent_reasoning_markers(request.enable_thinking)[1]


def generation_request(request: ChatRequest, prompt: Sequence[SegmentLike]) -> GenerationRequest:
    # A turn the grammar makes all calls (tool_choice required or named) ends where the
    # grammar says: a stop string would cut a call and hand its markup back as content.
    forced = request.tool_choice == "required" and bool(request.tools)
    grammar = turn_grammar(request)
    lazy = grammar is not None and grammar.trigger is not None
    # Under a grammar free text cannot spell the end-of-turn marker, but a JSON string may:
    # that stop string would only cut valid JSON short. A lazy grammar leaves text free.
    stops = [*(() if forced else request.stop),
             *(() if grammar and not lazy else (END_OF_TURN_TEXT,))]
    return GenerationRequest(
        prompt=prompt,
        sampling=request.sampling,
        max_tokens=request.max_tokens,
        stop=tuple(dict.fromkeys(stops)),
        parser=functools.partial(
            chat.StreamingParser,
            callable_tools(request),
            thinking=request.enable_thinking,
            parallel_tool_calls=request.parallel_tool_calls,
            calls_only_first=request.response_schema is not None,
            cut_calls=grammar is not None,
        ),
        grammar=grammar,
        banned_markers=banned_markers(request, grammar),
        once_markers=once_markers(request, grammar),
    )


@contextlib.contextmanager
def engine_errors(ended: str, request_id: str) -> Iterator[None]:
    """The engine's typed errors as the HTTP errors clients act on."""
    try:
        yield
    except ContextLengthExceeded as exc:
        raise context_length_exceeded(str(exc), exc.prompt_tokens, exc.max_context) from None
    except EngineBusy as exc:
        raise busy(str(exc) or "The server is busy; retry shortly.") from None
    except InvalidRequest as exc:
        raise invalid_request(str(exc), param=exc.param) from None
    except EngineFailure as exc:
        raise engine_failure(exc, request_id) from None
    except StopAsyncIteration:
        raise ApiError(500, ended, type="server_error") from None


class Completion:
    """Drives one generation: the engine's parsed events in, completion events out.

    ``start()`` waits for the engine's admission, so its up-front refusals (busy, prompt
    too long) surface as HTTP errors before any response header is sent.
    ``close()`` cancels the generation; it is safe to call at any time, more than once.
    """

    def __init__(self, engine: EngineProtocol, request: ChatRequest,
                 request_id: str = "-") -> None:
        self.request = request
        self._request_id = request_id
        self._engine = engine
        self._generation_request = generation_request(request, render_prompt(request))
        self._generation: AsyncIterator[GenerationEvent] | None = None
        self._first: GenerationEvent | None = None
        self.prompt_tokens = 0  # known at admission (``Admitted``); 0 before or without
        self._calls = 0
        self.finished: Finished | None = None

    @property
    def constrained(self) -> str | None:
        """What a grammar enforces on this answer (for the log and /metrics), else None."""
        if self._generation_request.grammar is None:
            return None
        r = self.request
        if r.forced_tool is not None:
            return "named"
        if r.allowed_tools is not None:
            return "allowed_tools"
        if r.tool_choice == "required":
            return "required"
        if r.response_schema is not None:
            return "response_format"
        if self._generation_request.grammar.trigger is not None:
            return "auto"  # the lazy grammar of plain auto's calls
        return "tools"  # auto with parallel_tool_calls false or a strict tool

    async def start(self) -> None:
        """Admission: returns once the engine accepted the request (``Admitted``); every
        refusal that needs no generation is raised here as an ``ApiError``, however long
        encoding the prompt takes, so it can still be a plain HTTP error."""
        # Inside the try: an engine may also refuse synchronously, not only on first event.
        with engine_errors("The engine ended without a result.", self._request_id):
            self._generation = self._engine.generate(self._generation_request)
            first = await anext(self._generation)
        if isinstance(first, Admitted):
            self.prompt_tokens = first.prompt_tokens
        else:  # an engine without admission events
            self._first = first

    async def events(self) -> AsyncIterator[CompletionEvent]:
        if self._generation is None:
            await self.start()
        event = self._first if self._first is not None else await self._next()
        self._first = None
        while True:
            if isinstance(event, Finished):
                self.finished = event
                yield dataclasses.replace(event, finish_reason=self._finish_reason(event))
                return
            if isinstance(event, ToolCallParsed):
                call = dataclasses.replace(event.call, id=chat.new_tool_call_id())
                yield ToolCallParsed(self._calls, call)
                self._calls += 1
            elif isinstance(event, ReasoningDelta | ContentDelta):
                yield event
            event = await self._next()

    async def _next(self) -> GenerationEvent:
        assert self._generation is not None
        with engine_errors("The engine stopped without finishing.", self._request_id):
            return await anext(self._generation)

    async def close(self) -> None:
        if self._generation is None:
            return
        closer = getattr(self._generation, "aclose", None)
        if closer is not None:
            await closer()

    def _finish_reason(self, finished: Finished) -> chat.FinishReason:
        if self._calls and finished.finish_reason == "length":
            return "length"  # a call cut by max_tokens or a budget bound, as OpenAI does
        if self._calls:
            return "tool_calls"
        if finished.finish_reason == "cancelled":
            raise ApiError(503, "The generation was cancelled by the server.", type="server_error")
        return finished.finish_reason

"""Incremental parser for Ling 3 assistant output: reasoning, content and tool calls.

One state machine serves both the streaming API and ``parse_assistant`` (which feeds the whole
text at once), so the two cannot drift; a hypothesis test checks that any split of a text gives
the same result. Rules (docs/serving.md section 3):

* ``thinking=True``: the prompt ended inside an open ``<think>``; reasoning runs to the first
  ``</think>``, or to the first ``<tool_call>`` when tools are declared (the model often opens a
  call without closing its thoughts). A leading ``<think>`` is consumed in either mode, so
  with ``thinking=False`` a model that opens a think block anyway still gets it split off.
  Output that never leaves reasoning stays reasoning (llama.cpp's rule); moving it to content
  at the end, as vLLM does, would reclassify text already streamed as reasoning.
* a ``<tool_call>`` block becomes a call only if it matches ``call_block.match_call``; otherwise
  its text is released unchanged as content and scanning resumes right after ``<tool_call>``.
  With ``parallel_tool_calls=False`` only the first call is taken; later blocks are content.
  With ``calls_only_first=True`` (a response format: JSON or calls) a block after content is
  content.
* separators the template writes are removed so that a message re-renders to the generated
  text: one ``\\n`` before a call (kept when the content before the first call is nothing but
  newlines and there is reasoning, because the template then writes exactly one ``\\n``), and
  whitespace between calls or after the last one. Other text after a call is content.
* with ``cut_calls=True`` (a turn whose calls a grammar keeps valid) a block the end of the
  turn cut short is the call it was writing (``call_block.cut_call``), never content.
* a ``<|role_end|>`` spelled as text at the very end is dropped; anywhere else it is text.
* nothing is emitted that could still change: a suffix that may start a marker is held back.
"""

from __future__ import annotations

from typing import Any

from .call_block import (
    INVALID,
    NEED_MORE,
    NEED_MORE_IN_VALUE,
    OPEN,
    VALUE_CLOSE,
    CallMatch,
    cut_call,
    match_call,
)
from .events import (
    ContentDelta,
    ParsedMessage,
    ParseEvent,
    ReasoningDelta,
    ToolCall,
    ToolCallParsed,
)
from .history import history_form
from .markers import ROLE_END, THINK_CLOSE, THINK_OPEN
from .tool_schema import tool_table


def _hold_length(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the tail of ``buf`` that may still become a marker (or is a trailing role_end)."""
    if ROLE_END in markers and buf.endswith(ROLE_END):
        return len(ROLE_END)
    longest = max(len(m) for m in markers)
    start = max(0, len(buf) - longest + 1)
    pos = buf.find("<", start)
    while pos >= 0:
        tail = buf[pos:]
        if any(m.startswith(tail) for m in markers):
            return len(tail)
        pos = buf.find("<", pos + 1)
    return 0


class StreamingParser:
    """Feed text deltas, get reasoning/content deltas and complete tool calls as they settle."""

    def __init__(
        self, tools: Any = None, *, thinking: bool = True, parallel_tool_calls: bool = True,
        calls_only_first: bool = False, cut_calls: bool = False,
    ) -> None:
        self._tools = tool_table(tools)
        # Under a grammar a block cut by max_tokens is a call, returned as far as it got
        # (OpenAI returns a cut call with finish_reason "length" too), never content.
        self._cut_calls = cut_calls
        self._thinking = thinking
        self._parallel = parallel_tool_calls
        # A response format's answer is JSON or calls (chat/turn_grammar.py): once content
        # has begun, a "<tool_call>" is text inside the JSON, never a call.
        self._calls_only_first = calls_only_first
        self._has_content = False  # content other than whitespace was emitted
        self._state = "start"
        self._buf = ""
        self._sep = ""  # a held "\n" that may be the template's separator before a call
        self._chunk = 0  # content chunks are separated by calls
        self._chunk_all_newlines = True
        self._events: list[ParseEvent] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False
        # Inside a long argument value nothing can change until a "<" arrives; deltas are
        # parked here instead of re-matching the growing block each time (keeps a 100K-char
        # file argument linear instead of quadratic).
        self._parked: list[str] = []
        self._may_park = False

    # ------------------------------------------------------------------ public API

    def feed(self, delta: str) -> list[ParseEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._may_park and "<" not in delta:
            self._parked.append(delta)
            return []
        self._unpark()
        self._buf += delta
        self._run(final=False)
        return self._drain()

    def _unpark(self) -> None:
        self._may_park = False
        if self._parked:
            self._buf += "".join(self._parked)
            self._parked = []

    def finish(self) -> list[ParseEvent]:
        if self._finished:
            return []
        self._unpark()
        self._run(final=True)
        self._finished = True
        return self._drain()

    def result(self) -> ParsedMessage:
        if not self._finished:
            raise RuntimeError("result() before finish()")
        return ParsedMessage("".join(self._reasoning), "".join(self._content), list(self._calls))

    @property
    def reasoning_done(self) -> bool:
        """The reasoning block is over (or the turn has none): what follows is the answer."""
        return self._state not in ("start", "reasoning")

    def history_text(self) -> str | None:
        """The text the template renders for this turn when a client sends it back as
        history (``history.history_form`` of ``result()``); after ``finish()``."""
        return history_form(self.result(), thinking=self._thinking)

    # ------------------------------------------------------------------ emission

    def _reason(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            self._events.append(ReasoningDelta(text))

    def _say(self, text: str) -> None:
        if text:
            if text.strip("\n"):
                self._chunk_all_newlines = False
            if text.strip():
                self._has_content = True
            self._content.append(text)
            self._events.append(ContentDelta(text))

    def _push_content(self, text: str, hold_newline: bool) -> None:
        text = self._sep + text
        self._sep = ""
        if hold_newline and text.endswith("\n"):
            self._sep, text = "\n", text[:-1]
        self._say(text)

    def _drain(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for ev in self._events:
            if out and type(ev) is type(out[-1]) and not isinstance(ev, ToolCallParsed):
                out[-1] = type(ev)(out[-1].text + ev.text)  # type: ignore[union-attr]
            else:
                out.append(ev)
        self._events = []
        return out

    # ------------------------------------------------------------------ states

    def _calls_allowed(self, before: str = "") -> bool:
        """Whether a call may start here; ``before``: content not yet emitted before it."""
        if self._calls_only_first and (self._has_content or before.strip()):
            return False
        return bool(self._tools) and (self._parallel or not self._calls)

    def _run(self, final: bool) -> None:
        handlers = {
            "start": self._start,
            "reasoning": self._in_reasoning,
            "content": self._in_content,
            "call": self._in_call,
            "after_call": self._after_call,
        }
        while handlers[self._state](final):
            pass

    def _start(self, final: bool) -> bool:
        buf = self._buf
        if buf.startswith(THINK_OPEN):
            self._buf = buf[len(THINK_OPEN) :]
            self._state = "reasoning"
            return True
        if not final and THINK_OPEN.startswith(buf):
            return False
        self._state = "reasoning" if self._thinking else "content"
        return True

    def _in_reasoning(self, final: bool) -> bool:
        buf = self._buf
        ends = (THINK_CLOSE, OPEN) if self._tools else (THINK_CLOSE,)
        hits = [(i, m) for m in ends if (i := buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            self._reason(buf[:i])
            self._buf = buf[i + len(THINK_CLOSE) :] if marker == THINK_CLOSE else buf[i:]
            self._state = "content"
            return True
        if final:
            self._reason(buf[: -len(ROLE_END)] if buf.endswith(ROLE_END) else buf)
            self._buf = ""
            return False
        keep = _hold_length(buf, (*ends, ROLE_END))
        self._reason(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _in_content(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(OPEN)
        if i >= 0:
            before = buf[:i]
        else:  # a held-back tail that may still become "<tool_call>" is not content yet
            before = buf if final else buf[: len(buf) - _hold_length(buf, (OPEN,))]
        allowed = self._calls_allowed(before)
        if allowed and i >= 0:
            self._push_content(buf[:i], hold_newline=True)
            self._buf = buf[i + len(OPEN) :]
            self._state = "call"
            return True
        if final:
            text = self._sep + buf
            self._sep = ""
            self._say(text[: -len(ROLE_END)] if text.endswith(ROLE_END) else text)
            self._buf = ""
            return False
        keep = _hold_length(buf, (OPEN, ROLE_END) if allowed else (ROLE_END,))
        self._push_content(buf[: len(buf) - keep], hold_newline=allowed)
        self._buf = buf[len(buf) - keep :]
        return False

    def _in_call(self, final: bool) -> bool:
        verdict = match_call(self._buf, self._tools, final)
        if verdict is NEED_MORE_IN_VALUE:
            self._may_park = "<" not in self._buf[-(len(VALUE_CLOSE) - 1) :]
            return False
        if verdict is NEED_MORE:
            return False
        if verdict is INVALID and final and self._cut_calls:
            cut = cut_call(self._buf, self._tools)
            self._sep = ""
            if cut is not None:
                self._events.append(ToolCallParsed(len(self._calls), cut))
                self._calls.append(cut)
            self._buf = ""
            self._state = "after_call"
            return False
        if verdict is INVALID:
            self._push_content(OPEN, hold_newline=False)
            self._state = "content"
            return True
        assert isinstance(verdict, CallMatch)
        if self._sep and self._chunk == 0 and self._reasoning and self._chunk_all_newlines:
            self._say(self._sep)
        self._sep = ""
        self._events.append(ToolCallParsed(len(self._calls), verdict.call))
        self._calls.append(verdict.call)
        self._buf = self._buf[verdict.end :]
        self._chunk += 1
        self._chunk_all_newlines = True
        self._state = "after_call"
        return True

    def _after_call(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        allowed = self._calls_allowed()
        if not stripped:
            if final:
                self._buf = ""
            return False
        if allowed and stripped.startswith(OPEN):
            self._buf = stripped[len(OPEN) :]
            self._state = "call"
            return True
        if not final and ((allowed and OPEN.startswith(stripped)) or ROLE_END.startswith(stripped)):
            return False
        if final and stripped == ROLE_END:
            self._buf = ""
            return False
        self._state = "content"
        return True

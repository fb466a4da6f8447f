"""Responses ``input`` items -> the chat messages the renderer takes.

One assistant turn of the Responses API is several items (``reasoning``, an assistant
``message``, ``function_call``s); they are merged back into the one assistant message the
chat route would get, in the order the model wrote them (reasoning, text, calls), so the
turn re-renders to exactly the text that was generated and the next turn hits the prefix
cache. ``function_call_output`` items become ``tool`` messages answering their call.
"""

from __future__ import annotations

from typing import Any

from ling3_rknn.server import reasoning_seal
from ling3_rknn.server.errors import shown
from ling3_rknn.server.json_checks import (
    MAX_PARTS,
    any_object,
    array,
    fail,
    join,
    json_object,
    nullable,
    one_of,
    string,
    text_or_parts,
    type_name,
    type_tag,
)
from ling3_rknn.server.param_names import ParamNames
from ling3_rknn.server.responses_api.tools import ToolSet
from ling3_rknn.server.validate import namespace_name, tool_name

ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ANY = lambda v, p: v  # noqa: E731  (accepted as sent: annotations, logprobs, ids)


def _part_text(value: Any, path: str) -> str:
    kind = type_tag(value, path)
    if kind not in _TEXT_PARTS:
        fail(join(path, "type"), f"content part type {kind!r} is not supported: this model "
                                 "reads text only")
    key = _TEXT_PARTS[kind]
    return json_object(value, path, {"type": string, key: string, "annotations": _ANY,
                                     "logprobs": _ANY}, ("type", key))[key]


# A string, or text parts joined by newlines (what the chat route does).
_text = text_or_parts(_part_text, "text parts")


_OMITTED = "[{kind} omitted: this model reads text only]"


def _output_part(value: Any, path: str) -> str:
    """A tool output part: text as is; an image or file (Codex's ``view_image`` returns
    one) becomes a note saying so, since refusing it would wedge the agent's session."""
    kind = type_tag(value, path)
    if kind in ("input_image", "input_file", "input_audio"):
        return _OMITTED.format(kind=kind.removeprefix("input_"))
    return _part_text(value, path)


def _output(value: Any, path: str) -> str:
    if isinstance(value, list):
        return "\n".join(array(_output_part, max_items=MAX_PARTS)(value, path))
    return _text(value, path)


def _message(value: Any, path: str) -> dict[str, Any]:
    fields = json_object(value, path, {
        "type": one_of("message"), "role": one_of(*ROLES), "content": _text,
        "id": string, "status": string, "phase": _ANY,
        "internal_chat_message_metadata_passthrough": _ANY,
    }, ("role", "content"))
    return {"role": fields["role"], "content": fields["content"]}


def _function_call(value: Any, path: str) -> dict[str, Any]:
    return json_object(value, path, {
        "type": string, "call_id": string, "name": tool_name, "arguments": string,
        "namespace": nullable(namespace_name), "id": string, "status": string,
    }, ("type", "call_id", "name", "arguments"))


def _function_call_output(value: Any, path: str) -> dict[str, Any]:
    return json_object(value, path, {
        "type": string, "call_id": string, "output": _output, "id": nullable(string),
        "status": nullable(string),
    }, ("type", "call_id", "output"))


def _summary_part(value: Any, path: str) -> str:
    return json_object(value, path, {"type": one_of("summary_text"), "text": string},
                       ("type", "text"))["text"]


def _reasoning_part(value: Any, path: str) -> str:
    return json_object(value, path, {"type": one_of("reasoning_text"), "text": string},
                       ("type", "text"))["text"]


def _reasoning(value: Any, path: str) -> str:
    """The reasoning text: from ``encrypted_content`` when present (checked), else the
    full ``content`` text, else the summary (this server's summary is the whole text)."""
    fields = json_object(value, path, {
        "type": string, "id": nullable(string), "summary": array(_summary_part),
        "content": nullable(array(_reasoning_part)), "encrypted_content": nullable(string),
        "status": nullable(string),
    }, ("type",))
    sealed = fields.get("encrypted_content")
    if sealed:
        text = reasoning_seal.unseal(sealed)
        if text is None:
            fail(join(path, "encrypted_content"), "not a value this server wrote, or it was "
                 "altered; send the item back as it was received, or omit encrypted_content")
        return text
    if fields.get("content"):
        return "".join(fields["content"])
    return "\n\n".join(fields.get("summary") or [])


class _Turns:
    """Builds the message list, merging one assistant turn's items into one message."""

    def __init__(self, tools: ToolSet) -> None:
        self.messages: list[dict[str, Any]] = []
        self.sources: list[str] = []  # the item (or field) each message began at
        self.call_sources: dict[tuple[int, int], str] = {}  # (message, call) -> its item
        self.where = "input"  # the item being read
        self._tools = tools
        self._assistant: dict[str, Any] | None = None
        self._open_calls: set[str] = set()  # call ids the next outputs may answer
        self._answered: set[str] = set()  # call ids with an output already

    def _turn(self) -> dict[str, Any]:
        if self._assistant is None:
            self._assistant = {"role": "assistant", "content": None}
            self._add(self._assistant)
            self._open_calls, self._answered = set(), set()
        return self._assistant

    def _add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.sources.append(self.where)

    def _close(self) -> None:
        self._assistant = None

    def reasoning(self, text: str) -> None:
        turn = self._assistant
        if turn is None or "reasoning_content" in turn or turn["content"] or "tool_calls" in turn:
            self._close()
            turn = self._turn()
        turn["reasoning_content"] = text

    def text(self, role: str, text: str) -> None:
        if role != "assistant":
            self._close()
            self._open_calls = set()
            self._add({"role": role, "content": text})
            return
        turn = self._turn()
        if "tool_calls" in turn:  # text after calls starts the model's next turn
            self._close()
            turn = self._turn()
        turn["content"] = text if turn["content"] is None else turn["content"] + "\n" + text

    def call(self, item: dict[str, Any]) -> None:
        turn = self._turn()
        name = self._tools.flat_name(item["name"], item.get("namespace"))
        self.call_sources[len(self.messages) - 1, len(turn.get("tool_calls", ()))] = self.where
        turn.setdefault("tool_calls", []).append({
            "id": item["call_id"], "type": "function",
            "function": {"name": name, "arguments": item["arguments"]},
        })
        self._open_calls.add(item["call_id"])

    def output(self, item: dict[str, Any], path: str) -> None:
        call_id = item["call_id"]
        if call_id in self._answered:
            fail(join(path, "call_id"), f"{shown(call_id)} was already answered by an "
                                        "earlier function_call_output")
        if call_id not in self._open_calls:
            fail(join(path, "call_id"), f"{shown(call_id)} does not answer a function_call "
                                        "of the assistant turn before it")
        self._open_calls.discard(call_id)
        self._answered.add(call_id)
        self._assistant = None  # the outputs end the turn; its other calls stay answerable
        self._add({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})


def read_input(value: Any, instructions: str | None, tools: ToolSet,
               path: str = "input") -> tuple[list[dict[str, Any]], ParamNames]:
    """Chat messages for ``instructions`` + ``input`` (a string or a list of items), and
    where each came from (for errors named after them)."""
    turns = _Turns(tools)
    if instructions:
        turns.where = "instructions"
        turns.text("system", instructions)
    turns.where = path
    if isinstance(value, str):
        turns.text("user", value)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            where = turns.where = f"{path}[{i}]"
            kind = any_object(item, where).get("type", "message")
            if kind == "message":
                message = _message(item, where)
                turns.text(message["role"], message["content"])
            elif kind == "function_call":
                turns.call(_function_call(item, where))
            elif kind == "function_call_output":
                turns.output(_function_call_output(item, where), where)
            elif kind == "reasoning":
                turns.reasoning(_reasoning(item, where))
            elif kind == "item_reference":
                fail(where, "item references need stored responses, which this server does "
                            "not keep (send the items themselves)")
            else:
                fail(join(where, "type"), f"input item type {kind!r} is not supported here "
                     "(message, function_call, function_call_output, reasoning)")
    else:
        fail(path, f"expected a string or an array of input items, got {type_name(value)}")
    if not any(m["role"] != "system" for m in turns.messages):
        fail(path, "expected at least one input message or item")
    names = ParamNames(path, turns.sources, turns.call_sources, list(tools.paths),
                       call_fields={".name": ".name", ".arguments": ".arguments"},
                       renames={"response_format.json_schema.schema": "text.format.schema",
                                "response_format": "text.format",
                                "tool_choice.allowed_tools.tools": "tool_choice.tools"})
    return turns.messages, names

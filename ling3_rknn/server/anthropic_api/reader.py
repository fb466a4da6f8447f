"""``POST /v1/messages`` body -> the one internal chat request (``validate.ChatRequest``).

Anthropic's content blocks map onto the chat messages the renderer takes: an assistant
message's ``thinking`` / ``text`` / ``tool_use`` blocks become one assistant message with
its reasoning, text and calls (in the order the model wrote them, so the turn re-renders
byte for byte and the next turn hits the prefix cache); a user message's ``tool_result``
blocks become ``tool`` messages and its text a user message. Keys are checked strictly,
unknown ones are a 400 naming their path (``messages[1].content[0].input``);
``cache_control`` markers are accepted everywhere and change nothing (the prefix cache is
automatic). Each chat message, call and tool keeps its place in the body (``ParamNames``),
so an error raised after rendering (the turn grammar, the engine) names the Messages
fields too (``tools[1].input_schema...``, never ``tools[0].function.parameters...``).
Details: docs/serving.md 10.4.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ling3_rknn.engine.api import SamplingParams
from ling3_rknn.server import reasoning_seal
from ling3_rknn.server.errors import invalid_request, shown
from ling3_rknn.server.json_checks import (
    MAX_PARTS,
    Invalid,
    any_object,
    array,
    boolean,
    fail,
    integer,
    join,
    json_object,
    nullable,
    number,
    one_of,
    string,
    text_or_parts,
    type_name,
    type_tag,
)
from ling3_rknn.server.param_names import ParamNames
from ling3_rknn.server.validate import MAX_STOP_STRINGS, ChatRequest, tool_name

log = logging.getLogger("ling3_rknn.server")
_ANY = lambda v, p: v  # noqa: E731  (accepted as sent, changes nothing here)
# Anthropic-run tools (web search, code execution, ...) and client tools with a fixed
# schema the model was trained on elsewhere (bash, text editor, computer): skipped.
_SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "bash_",
                         "text_editor_", "computer_", "memory_", "tool_search_")


@dataclass(frozen=True)
class MessagesNotes:
    """What the writer needs besides the chat request."""

    stop_sequences: tuple[str, ...]
    show_thinking: bool = True


# ---- content blocks ---------------------------------------------------------------------


def _text_block(value: Any, path: str) -> str:
    kind = type_tag(value, path)
    if kind != "text":
        fail(join(path, "type"), f"content block type {kind!r} is not supported here: this "
                                 "model reads text only")
    return json_object(value, path, {"type": string, "text": string, "cache_control": _ANY,
                                     "citations": _ANY}, ("type", "text"))["text"]


_texts = text_or_parts(_text_block, "text blocks")


def _result_block(value: Any, path: str) -> str:
    """A tool result block: text as is; an image or document (Claude Code's Read returns
    one for an image file) becomes a note saying so, since refusing it would wedge the
    agent's session."""
    kind = type_tag(value, path)
    if kind in ("image", "document"):
        return f"[{kind} omitted: this model reads text only]"
    return _text_block(value, path)


def _result_content(value: Any, path: str) -> str:
    if isinstance(value, list):
        return "\n".join(array(_result_block, max_items=MAX_PARTS)(value, path))
    return _texts(value, path)


_BLOCKS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "text": ({"type": string, "text": string, "cache_control": _ANY, "citations": _ANY},
             ("text",)),
    "thinking": ({"type": string, "thinking": string, "signature": string}, ("thinking",)),
    "redacted_thinking": ({"type": string, "data": string}, ("data",)),
    "tool_use": ({"type": string, "id": string, "name": tool_name, "input": any_object,
                  "cache_control": _ANY, "caller": _ANY}, ("id", "name", "input")),
    "tool_result": ({"type": string, "tool_use_id": string,
                     "content": nullable(_result_content), "is_error": nullable(boolean),
                     "cache_control": _ANY}, ("tool_use_id",)),
}
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "system": ("text",),
                "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}


def _block(value: Any, path: str, role: str) -> dict[str, Any]:
    kind = type_tag(value, path)
    if kind not in _ROLE_BLOCKS[role]:
        allowed = ", ".join(repr(k) for k in _ROLE_BLOCKS[role])
        fail(join(path, "type"), f"{role} content blocks here are {allowed}; got {kind!r} "
                                 "(this model reads text only)")
    fields, required = _BLOCKS[kind]
    return json_object(value, path, fields, ("type", *required))


# ---- messages ---------------------------------------------------------------------------


def _thinking_text(block: dict[str, Any], path: str) -> str:
    """The reasoning of a ``thinking`` block. Our signature carries the text (sealed), so a
    block whose text was omitted (``display: "omitted"``) still renders what the model
    wrote; a block whose text differs from its signature's is refused. Another server's
    signature is not ours to check: the text is used as sent."""
    text, signature = block["thinking"], block.get("signature") or ""
    if not reasoning_seal.is_sealed(signature):
        return text
    sealed = reasoning_seal.unseal(signature)
    if sealed is None or (text and text != sealed):
        fail(join(path, "signature"), "the thinking block does not match its signature: "
                                      "send thinking blocks back unchanged")
    return sealed


def _assistant(blocks: list[dict[str, Any]], path: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "thinking":
            text = _thinking_text(block, f"{path}.content[{j}]")
            message["reasoning_content"] = message.get("reasoning_content", "") + text
        elif kind == "text":
            texts.append(block["text"])
        elif kind == "tool_use":
            message.setdefault("tool_calls", []).append({
                "id": block["id"], "type": "function",
                "function": {"name": block["name"], "arguments": block["input"]}})
        # redacted_thinking: another server's opaque reasoning; nothing to render.
    if texts:
        message["content"] = "\n".join(texts)
    return message


def _user(blocks: list[dict[str, Any]], path: str, calls: set[str]
          ) -> list[tuple[dict[str, Any], str]]:
    """The tool messages of the ``tool_result`` blocks, then the text as one user message,
    each with the path it came from."""
    out: list[tuple[dict[str, Any], str]] = []
    texts: list[str] = []
    answered: set[str] = set()
    for j, block in enumerate(blocks):
        if block["type"] == "tool_result":
            use_id = block["tool_use_id"]
            if use_id in answered:
                fail(f"{path}.content[{j}].tool_use_id",
                     f"{shown(use_id)} was already answered by an earlier tool_result")
            if use_id not in calls:
                fail(f"{path}.content[{j}].tool_use_id",
                     f"{shown(use_id)} is not the id of a tool_use block of the "
                     "assistant message before it")
            answered.add(use_id)
            out.append(({"role": "tool", "tool_call_id": block["tool_use_id"],
                         "content": block.get("content") or ""}, f"{path}.content[{j}]"))
        else:
            texts.append(block["text"])
    if texts:
        out.append(({"role": "user", "content": "\n".join(texts)}, path))
    return out


@dataclass
class _Conversation:
    """The chat messages, and where each message and call came from in the body (errors
    raised after rendering name the Messages fields, never the chat ones)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    call_sources: dict[tuple[int, int], str] = field(default_factory=dict)

    def add(self, message: dict[str, Any], source: str) -> None:
        self.messages.append(message)
        self.sources.append(source)

    def prepend_system(self, content: str) -> None:
        self.messages.insert(0, {"role": "system", "content": content})
        self.sources.insert(0, "system")
        self.call_sources = {(i + 1, c): p for (i, c), p in self.call_sources.items()}


def _messages(value: Any, path: str) -> _Conversation:
    items = array(lambda v, p: json_object(
        v, p, {"role": one_of("user", "assistant", "system"), "content": _ANY},
        ("role", "content")),
        min_items=1)(value, path)
    out = _Conversation()
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        role, content = item["role"], item["content"]
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            if len(content) > MAX_PARTS:
                fail(join(where, "content"), f"expected at most {MAX_PARTS} content blocks, "
                                             f"got {len(content)}")
            blocks = [_block(b, f"{where}.content[{j}]", role) for j, b in enumerate(content)]
        else:
            fail(join(where, "content"), "expected a string or an array of content blocks, "
                                         f"got {type_name(content)}")
        if role == "assistant":
            message = _assistant(blocks, where)
            calls = {c["id"] for c in message.get("tool_calls", ())}
            uses = [j for j, b in enumerate(blocks) if b["type"] == "tool_use"]
            for c, j in enumerate(uses):
                out.call_sources[len(out.messages), c] = f"{where}.content[{j}]"
            out.add(message, where)
        elif role == "system":  # Claude Code's mid-conversation system turns
            out.add({"role": "system", "content": "\n".join(b["text"] for b in blocks)},
                    where)
        else:
            for message, source in _user(blocks, where, calls):
                out.add(message, source)
            calls = set()
    return out


# ---- tools ------------------------------------------------------------------------------


def _tools(value: Any, path: str) -> list[tuple[dict[str, Any], str]]:
    """The chat tools, each with its path in the body (server tools skipped, so a chat
    tool's index is not the body's)."""
    tools: list[tuple[dict[str, Any], str]] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for i, tool in enumerate(array(any_object)(value, path)):
        where = f"{path}[{i}]"
        kind = tool.get("type")
        if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
            skipped.append(kind)
            continue
        fields = json_object(tool, where, {
            "type": nullable(one_of("custom")), "name": tool_name,
            "description": nullable(string), "input_schema": any_object,
            "cache_control": _ANY, "defer_loading": nullable(boolean),
            "strict": nullable(boolean), "eager_input_streaming": nullable(boolean),
        }, ("name", "input_schema"))
        if fields["name"] in seen:
            fail(join(where, "name"), f"duplicate tool name {fields['name']!r}")
        seen.add(fields["name"])
        function = {"name": fields["name"], "parameters": fields["input_schema"]}
        if fields.get("description"):
            function["description"] = fields["description"]
        tools.append(({"type": "function", "function": function}, where))
    if skipped:
        log.info("messages: skipped server tools this server cannot run: %s", ", ".join(skipped))
    return tools


def _tool_choice(value: Any, path: str, names: set[str]
                 ) -> tuple[str, str | None, bool]:
    """(mode, forced tool, parallel calls allowed)."""
    fields = json_object(value, path, {
        "type": one_of("auto", "any", "tool", "none"), "name": tool_name,
        "disable_parallel_tool_use": nullable(boolean),
    }, ("type",))
    parallel = not fields.get("disable_parallel_tool_use")
    kind = fields["type"]
    if kind == "tool":
        if "name" not in fields:
            fail(join(path, "name"), "this field is required with type 'tool'")
        if fields["name"] not in names:
            fail(join(path, "name"), f"{fields['name']!r} is not one of the declared tools")
        return "required", fields["name"], parallel
    if "name" in fields:
        fail(join(path, "name"), f"only allowed with type 'tool', not {kind!r}")
    if kind == "any":
        if not names:
            fail(path, "'any' needs at least one tool in 'tools'")
        return "required", None, parallel
    return kind, None, parallel


# ---- top level --------------------------------------------------------------------------


@dataclass(frozen=True)
class Thinking:
    enabled: bool
    shown: bool  # False with display "omitted": the text travels only in the signature


def _thinking(value: Any, path: str) -> Thinking:
    kind = type_tag(value, path)
    display = nullable(one_of("summarized", "omitted"))
    if kind == "enabled":
        fields = json_object(value, path, {"type": string, "budget_tokens": integer(1),
                                           "display": display}, ("type", "budget_tokens"))
    else:
        fields = json_object(value, path, {"type": one_of("disabled", "adaptive"),
                                           "display": display}, ("type",))
    return Thinking(fields["type"] != "disabled", fields.get("display") != "omitted")


def _stops(value: Any, path: str) -> tuple[str, ...]:
    stops = array(string, max_items=MAX_STOP_STRINGS)(value, path)
    for i, stop in enumerate(stops):
        if not stop:
            fail(f"{path}[{i}]", "stop sequences must not be empty")
    return tuple(stops)


_TOP_LEVEL = {
    "model": string,
    "messages": _ANY,  # checked in _messages
    "max_tokens": integer(1),
    "system": nullable(_texts),
    "stop_sequences": nullable(_stops),
    "stream": nullable(boolean),
    "temperature": nullable(number(0.0, 1.0)),
    "top_p": nullable(number(0.0, 1.0, open_low=True)),
    "top_k": nullable(integer(0)),
    "tools": nullable(_tools),
    "tool_choice": _ANY,  # checked once the tools are known
    "thinking": nullable(_thinking),
    "metadata": nullable(lambda v, p: json_object(v, p, {"user_id": nullable(string)})),
    "service_tier": nullable(one_of("auto", "standard_only")),
    # Claude Code's hints for Anthropic's own servers: accepted, nothing to change here.
    "context_management": nullable(any_object),
    "output_config": nullable(any_object),
}


def read_messages_request(body: dict[str, Any], *, count_only: bool = False
                          ) -> tuple[ChatRequest, MessagesNotes]:
    """Validate a decoded body; raise ``ApiError`` (400) naming the offending param.
    ``count_only``: the ``count_tokens`` body, which has no ``max_tokens``."""
    try:
        required = ("model", "messages") if count_only else ("model", "messages", "max_tokens")
        fields = json_object(body, "", _TOP_LEVEL, required)
        conversation = _messages(fields["messages"], "messages")
        tools = [tool for tool, _ in fields.get("tools") or ()]
        names = {t["function"]["name"] for t in tools}
        choice, forced, parallel = "auto", None, True
        if body.get("tool_choice") is not None:
            choice, forced, parallel = _tool_choice(body["tool_choice"], "tool_choice", names)
    except Invalid as exc:
        raise invalid_request(exc.message, exc.param) from None
    if fields.get("system"):
        conversation.prepend_system(fields["system"])
    stops = fields.get("stop_sequences") or ()
    thinking = fields.get("thinking") or Thinking(enabled=False, shown=True)
    request = ChatRequest(
        model=fields["model"],
        messages=conversation.messages,
        tools=tools or None,
        tool_choice=choice,
        forced_tool=forced,
        parallel_tool_calls=parallel,
        stream=bool(fields.get("stream")),
        include_usage=True,
        max_tokens=fields.get("max_tokens"),
        stop=stops,
        sampling=SamplingParams(temperature=fields.get("temperature"),
                                top_p=fields.get("top_p"), top_k=fields.get("top_k")),
        # Anthropic's default is no extended thinking; `thinking` turns it on.
        enable_thinking=thinking.enabled,
        names=ParamNames("messages", conversation.sources, conversation.call_sources,
                         [where for _, where in fields.get("tools") or ()],
                         schema_key="input_schema",
                         call_fields={".name": ".name", ".arguments": ".input"},
                         message_fields={".tool_call_id": ".tool_use_id"}),
    )
    return request, MessagesNotes(stops, thinking.shown)

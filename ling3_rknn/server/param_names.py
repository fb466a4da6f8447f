"""Error paths in each API's own names. Rendering, the turn grammar and the engine name the
request parts they refuse in the chat route's terms (``messages[1].tool_calls[0].function
.arguments``, ``tools[3].function.parameters``, ``response_format.json_schema.schema``);
a Responses or Messages client sent neither ``messages`` nor ``function`` wrappers. Each
reader records where every chat message, call and tool came from, and the flow renames an
error's ``param`` and the paths its message quotes before it goes out."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ling3_rknn.server.errors import ApiError

_PATH = re.compile(r"(?:messages|tools)(?:\[\d+\])?(?:\.[A-Za-z_]\w*|\[\d+\])*"
                   r"|response_format(?:\.[A-Za-z_]\w*)*|tool_choice(?:\.[A-Za-z_]\w*)*")
_CALL = re.compile(r"messages\[(\d+)\]\.tool_calls\[(\d+)\](?:\.function)?(.*)")
_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")
_TOOL = re.compile(r"tools\[(\d+)\](?:\.function)?(.*)")


@dataclass
class ParamNames:
    """Where the chat request's parts came from in the client's own body."""

    messages: str  # the body's field for the conversation ("input", "messages")
    message_paths: list[str] = field(default_factory=list)  # chat message i -> its source
    call_paths: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> source
    tool_paths: list[str] = field(default_factory=list)  # chat tool i -> its source
    schema_key: str = "parameters"  # a tool's schema field
    call_fields: dict[str, str] = field(default_factory=dict)  # ".arguments" -> ".input"
    message_fields: dict[str, str] = field(default_factory=dict)  # ".tool_call_id" -> ...
    renames: dict[str, str] = field(default_factory=dict)  # whole-prefix renames

    def path(self, chat: str) -> str:
        """One chat path in the client's terms (unchanged when nothing maps it)."""
        for old, new in sorted(self.renames.items(), key=lambda kv: -len(kv[0])):
            if chat == old or chat.startswith(old + "."):
                return new + chat[len(old):]
        if (m := _CALL.fullmatch(chat)) and (int(m[1]), int(m[2])) in self.call_paths:
            rest = m[3]
            for old, new in self.call_fields.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
            return self.call_paths[int(m[1]), int(m[2])] + rest
        if (m := _MESSAGE.fullmatch(chat)) and int(m[1]) < len(self.message_paths):
            rest = m[2]
            for old, new in self.message_fields.items():
                if rest == old or rest.startswith(old + "."):
                    rest = new + rest[len(old):]
            return self.message_paths[int(m[1])] + rest
        if (m := _TOOL.fullmatch(chat)) and int(m[1]) < len(self.tool_paths):
            rest = m[2]
            if rest.startswith(".parameters"):
                rest = "." + self.schema_key + rest[len(".parameters"):]
            return self.tool_paths[int(m[1])] + rest
        if chat == "messages":
            return self.messages
        return chat

    def error(self, error: ApiError) -> ApiError:
        """``error`` with its param and the chat paths its message quotes renamed."""
        param = None if error.param is None else self.path(error.param)
        message = _PATH.sub(lambda m: self.path(m[0]), error.message)
        if param == error.param and message == error.message:
            return error
        return ApiError(error.status, message, type=error.type, param=param,
                        code=error.code, headers=error.headers, details=error.details)


def renamed(names: ParamNames | None, error: ApiError) -> ApiError:
    return error if names is None else names.error(error)



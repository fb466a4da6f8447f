"""Responses ``tools`` and ``tool_choice`` -> the chat request's function tools.

Function tools come in the Responses' flat form (``{"type": "function", "name", ...}``).
A ``namespace`` tool (Codex groups MCP tools this way) is flattened into its function tools
under ``<namespace>__<name>``, Codex's own flat spelling; the writer splits a call of such a
name back into ``name`` + ``namespace``, which is what Codex routes on. Hosted tools the
server cannot run (web search, file search, code interpreter, ...) are skipped with one log
line: a client that always offers them (Codex offers ``web_search``) still works, and the
model simply never sees them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ling3_rknn.server.json_checks import (
    any_object,
    array,
    boolean,
    fail,
    join,
    json_object,
    nullable,
    one_of,
    string,
    type_name,
    type_tag,
)
from ling3_rknn.server.validate import namespace_name, tool_name

log = logging.getLogger("ling3_rknn.server")

# Responses tool types that run on OpenAI's side; accepted and left out of the prompt.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "code_interpreter", "image_generation", "computer_use", "computer_use_preview",
    "computer", "mcp", "local_shell", "shell", "apply_patch", "custom", "tool_search",
})
NAMESPACE_SEPARATOR = "__"


@dataclass
class ToolSet:
    """The chat form of the request's tools and how to name their calls on the way out."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (ns, name)
    skipped: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # each tool's place in the body

    def flat_name(self, name: str, namespace: str | None) -> str:
        return name if namespace is None else join_namespace(namespace, name)


def join_namespace(namespace: str, name: str) -> str:
    """Codex's flat spelling of a namespaced tool (``ToolName::canonical_flat_name``)."""
    return namespace.rstrip("_") + NAMESPACE_SEPARATOR + name.lstrip("_")


_FUNCTION_FIELDS = {
    "type": one_of("function"),
    "name": tool_name,
    "description": nullable(string),
    "parameters": nullable(any_object),
    "strict": nullable(boolean),
    "defer_loading": nullable(boolean),
}


def _function(value: Any, path: str) -> dict[str, Any]:
    fields = json_object(value, path, _FUNCTION_FIELDS, ("type", "name"))
    function = {"name": fields["name"]}
    for key in ("description", "parameters", "strict"):
        if fields.get(key) is not None:
            function[key] = fields[key]
    return {"type": "function", "function": function}


def _namespace(value: Any, path: str) -> dict[str, Any]:
    return json_object(value, path, {
        "type": one_of("namespace"),
        "name": namespace_name,
        "description": nullable(string),
        "tools": array(_function),
    }, ("type", "name", "tools"))


def read_tools(value: Any, path: str = "tools") -> ToolSet:
    if value is None:
        return ToolSet()
    if not isinstance(value, list):
        fail(path, f"expected an array, got {type_name(value)}")
    out = ToolSet()
    seen: dict[str, str] = {}
    for i, tool in enumerate(value):
        where = f"{path}[{i}]"
        kind = type_tag(tool, where)
        if kind == "function":
            entries = [(_function(tool, where), where, None)]
        elif kind == "namespace":
            space = _namespace(tool, where)
            entries = [(t, f"{where}.tools[{j}]", space["name"])
                       for j, t in enumerate(space["tools"])]
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            out.skipped.append(kind)
            continue
        else:
            fail(join(where, "type"), f"unsupported tool type {kind!r}: this server runs "
                                      "'function' and 'namespace' tools")
            raise AssertionError("unreachable")
        for entry, tool_path, namespace in entries:
            name_path = join(tool_path, "name")
            name = entry["function"]["name"]
            if namespace is not None:
                flat = join_namespace(namespace, name)
                out.namespaces[flat] = (namespace, name)
                entry["function"]["name"] = name = flat
            if name in seen:
                fail(name_path, f"duplicate tool name {name!r} (also {seen[name]})")
            seen[name] = name_path
            out.tools.append(entry)
            out.paths.append(tool_path)
    if out.skipped:
        log.info("responses: skipped hosted tools this server cannot run: %s",
                 ", ".join(out.skipped))
    return out


def read_tool_choice(value: Any, tools: ToolSet, path: str = "tool_choice"
                     ) -> tuple[str, str | None, tuple[str, ...] | None]:
    """(mode, forced tool, allowed subset), as the chat request carries them."""
    names = {t["function"]["name"] for t in tools.tools}
    if value is None or value == "auto":
        return "auto", None, None
    if value == "none":
        return "none", None, None
    if value == "required":
        if not names:
            fail(path, "'required' needs at least one function tool in 'tools'")
        return "required", None, None
    if not isinstance(value, dict):
        fail(path, "expected 'auto', 'none', 'required', a function or allowed_tools, "
                   f"got {value!r}")
    if value.get("type") == "function":
        named = json_object(value, path, {"type": string, "name": tool_name}, ("type", "name"))
        if named["name"] not in names:
            fail(join(path, "name"), f"{named['name']!r} is not one of the declared tools")
        return "required", named["name"], None
    if value.get("type") == "allowed_tools":
        fields = json_object(value, path, {
            "type": string,
            "mode": one_of("auto", "required"),
            "tools": array(lambda v, p: json_object(
                v, p, {"type": one_of("function"), "name": tool_name}, ("type", "name")),
                min_items=1),
        }, ("type", "mode", "tools"))
        allowed = []
        for i, tool in enumerate(fields["tools"]):
            if tool["name"] not in names:
                fail(f"{path}.tools[{i}].name", f"{tool['name']!r} is not one of the declared "
                                                 "tools")
            allowed.append(tool["name"])
        return fields["mode"], None, tuple(dict.fromkeys(allowed))
    fail(join(path, "type"), f"tool_choice type {value.get('type')!r} is not supported: this "
                             "server runs function tools only")
    raise AssertionError("unreachable")

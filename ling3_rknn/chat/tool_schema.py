"""Declared tools as the parser needs them: names and the JSON type(s) of each parameter."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

_JSON_TYPES = {"string", "integer", "number", "boolean", "object", "array", "null"}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    params: dict[str, frozenset[str]]  # parameter -> allowed JSON types (empty: unknown)
    required: tuple[str, ...]


def resolve_ref(schema: Any, root: Any) -> Any:
    """A parameter schema with a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``, as
    pydantic writes them) replaced by its target, sibling keywords kept; else unchanged."""
    seen: set[str] = set()
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        parts = ref.split("/")
        if ref in seen or len(parts) != 3 or parts[0] != "#" or not isinstance(root, dict):
            return schema
        seen.add(ref)
        target = (root.get(parts[1]) or {}).get(parts[2]) if isinstance(
            root.get(parts[1]), dict) else None
        if not isinstance(target, dict):
            return schema
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **siblings}
    return schema


def json_types(schema: Any) -> set[str]:
    """JSON types a schema admits, looking through anyOf/oneOf/allOf, enum and const."""
    if not isinstance(schema, dict):
        return set()
    out: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        out.add(kind)
    elif isinstance(kind, list):
        out.update(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else []:
            out |= json_types(sub)
    enum = schema.get("enum")
    values = list(enum) if isinstance(enum, list) else []
    if "const" in schema:
        values.append(schema["const"])
    if not kind:
        out.update(json_type(v) for v in values)
    return out & _JSON_TYPES


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def tool_table(tools: Any) -> dict[str, ToolSpec]:
    """OpenAI ``tools`` (or bare function dicts) -> name -> spec; malformed entries are skipped
    (the server validates requests; the parser only needs what it can use)."""
    table: dict[str, ToolSpec] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = function if isinstance(function := tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            continue
        params = given if isinstance(given := fn.get("parameters"), dict) else {}
        props = given if isinstance(given := params.get("properties"), dict) else {}
        required = given if isinstance(given := params.get("required"), list) else []
        table[name] = ToolSpec(
            name,
            {k: frozenset(json_types(resolve_ref(v, params))) for k, v in props.items()},
            tuple(r for r in required if isinstance(r, str)),
        )
    return table


def _reject_constant(name: str) -> float:
    raise ValueError(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def coerce_value(raw: str, types: frozenset[str]) -> Any:
    """Typed value of one ``<arg_value>``.

    String-only parameters keep the raw text (no JSON decoding, no trimming). Otherwise the text
    is parsed as JSON; a value that does not parse (or, for a type list that admits strings,
    parses to a type the schema does not allow, like ``"123"`` for ``["string", "null"]``) stays
    the raw string. NaN/Infinity are not JSON and stay strings, as does a value with a number
    beyond the float range anywhere in it (``2e400``), which would otherwise reach the client
    as ``Infinity``.
    """
    if types == {"string"}:
        return raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return raw
    kind = json_type(value)
    if kind == "integer" and "number" in types:
        kind = "number"
    if "string" in types and kind not in types:
        return raw
    return value

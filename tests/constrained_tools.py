"""Tool declarations and checks shared by the constrained-decoding tests.

Strings are bounded (``maxLength``) and numbers ranged so that a random-weight model, which
never chooses to close a free string, still finishes a forced call within a few dozen tokens.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from ling3_rknn.chat import ParsedMessage

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    }, "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 10},
        "exact": {"type": "boolean"},
        "filters": {"$ref": "#/$defs/Filters"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    }, "required": ["query"],
        "$defs": {"Filters": {"type": "object", "properties": {
            "lang": {"enum": ["py", "rs"]}}, "required": ["lang"],
            "additionalProperties": False}}}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {}}}}
TOOLS = [WEATHER, SEARCH, PING]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 8},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "sources": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "maxItems": 3},
}, "required": ["answer", "confidence"], "additionalProperties": False}


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The tool's schema with no undeclared argument allowed (what the grammar promises)."""
    return {**schema, "additionalProperties": False}


def check_calls(message: ParsedMessage, allowed: set[str], *, at_least: int,
                at_most: int | None) -> None:
    """Every call is of an allowed tool with schema-valid arguments; the count is in range."""
    calls = message.tool_calls
    assert at_least <= len(calls), message
    assert at_most is None or len(calls) <= at_most, message
    for call in calls:
        assert call.name in allowed, message
        jsonschema.validate(call.arguments, closed(SCHEMAS[call.name]))

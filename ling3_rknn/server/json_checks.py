"""Checkers for untrusted JSON: each takes a value and its path in OpenAI's notation
(``messages[2].content``) and returns the value or raises ``Invalid`` naming that path.

The request schema in ``validate.py`` is built from these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from ling3_rknn.server.errors import shown


class Invalid(Exception):
    """A value that breaks the schema; ``param`` is its path (None: the body)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


Check = Callable[[Any, str], Any]


def fail(path: str, message: str) -> NoReturn:
    raise Invalid(f"{path}: {message}" if path else message, path or None)


# JSON nested deeper than this anywhere in a body is refused before any code walks it
# recursively (schema rewriting, rendering, json.dumps): Python's recursion limit would
# otherwise turn a client's 600-deep schema into a 500. Real schemas and histories stay
# far below (a tool parameter nested 20 objects deep is about 45 levels of the body).
MAX_DEPTH = 128


# Content parts (blocks) in one message or one tool result. Each costs little JSON and can
# cost more prompt: an image block in a tool result becomes a 40-character note, so 100k of
# them (3.3 MB) made 2.3 M tokens. Refused before any of them is read; agents send tens.
MAX_PARTS = 1000


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise ``Invalid`` naming the first place ``value`` nests deeper than ``limit``
    (iterative: the check itself cannot overflow the stack)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = ((join(path, str(k)), v) for k, v in node.items())
        elif isinstance(node, list):
            children = ((f"{path}[{i}]", v) for i, v in enumerate(node))
        else:
            continue
        if depth >= limit:
            fail(path, f"nested more than {limit} levels deep")
        stack.extend((child, where, depth + 1) for where, child in children
                     if isinstance(child, dict | list))


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def json_object(
    value: Any,
    path: str,
    fields: Mapping[str, Check],
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Check an object's keys (unknown ones rejected by name) and each field's value."""
    if not isinstance(value, dict):
        fail(path, f"expected an object, got {type_name(value)}")
    for key in value:
        if key not in fields:
            where = join(path, str(key))
            raise Invalid(f"Unrecognized request argument supplied: {where}", where)
    for key in required:
        if key not in value:
            fail(join(path, key), "this field is required")
    return {key: fields[key](item, join(path, key)) for key, item in value.items()}


def nullable(check: Check) -> Check:
    def run(value: Any, path: str) -> Any:
        return None if value is None else check(value, path)

    return run


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        fail(path, f"expected a string, got {type_name(value)}")
    return value


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        fail(path, f"expected a boolean, got {type_name(value)}")
    return value


def integer(low: int | None = None, high: int | None = None) -> Check:
    def run(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, f"expected an integer, got {type_name(value)}")
        if low is not None and value < low:
            fail(path, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            fail(path, f"must be <= {high}, got {value}")
        return value

    return run


def number(
    low: float | None = None, high: float | None = None, *, open_low: bool = False
) -> Check:
    def run(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(path, f"expected a number, got {type_name(value)}")
        if value != value or value in (float("inf"), float("-inf")):
            fail(path, "must be a finite number")
        if low is not None and (value <= low if open_low else value < low):
            fail(path, f"must be {'>' if open_low else '>='} {low}, got {value}")
        if high is not None and value > high:
            fail(path, f"must be <= {high}, got {value}")
        return float(value)

    return run


def one_of(*choices: Any) -> Check:
    def run(value: Any, path: str) -> Any:
        if isinstance(value, bool) or value not in choices:
            options = ", ".join(repr(c) for c in choices)
            fail(path, f"expected one of {options}, got {shown(value)}")
        return value

    return run


def any_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(path, f"expected an object, got {type_name(value)}")
    return value


def type_tag(value: Any, path: str) -> str | None:
    """An object's ``type`` field, which tagged unions switch on: a string, or None when
    absent; anything else is a 400 naming it (never a lookup of an unhashable value)."""
    kind = any_object(value, path).get("type")
    if kind is not None and not isinstance(kind, str):
        fail(join(path, "type"), f"expected a string, got {type_name(kind)}")
    return kind


def string_map(value: Any, path: str) -> dict[str, str]:
    value = any_object(value, path)
    for key, item in value.items():
        string(item, join(path, key))
    return value


def array(item: Check, *, min_items: int = 0, max_items: int | None = None) -> Check:
    def run(value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            fail(path, f"expected an array, got {type_name(value)}")
        if len(value) < min_items:
            fail(path, f"expected at least {min_items} item(s)")
        if max_items is not None and len(value) > max_items:
            fail(path, f"expected at most {max_items} items, got {len(value)}")
        return [item(element, f"{path}[{i}]") for i, element in enumerate(value)]

    return run


def text_or_parts(part: Check, what: str) -> Check:
    """A string, or an array of text parts (each read by ``part``) joined by newlines: how
    the chat route, the Responses API and the Messages API all take a message's text."""

    def run(value: Any, path: str) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "\n".join(array(part, max_items=MAX_PARTS)(value, path))
        fail(path, f"expected a string or an array of {what}, got {type_name(value)}")

    return run

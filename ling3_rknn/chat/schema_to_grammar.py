"""One argument value's JSON schema as grammar rules: raw-string lexemes and embedded JSON.

The turn grammar (``turn_grammar.py``) writes the shape of a turn: markers, calls, the
order of their arguments. What one value may be is a separate job, and most of this
module: a string-only parameter is written unquoted by the template, so its schema
(``enum``/``const``, ``pattern``, ``minLength``/``maxLength``, the common ``format``s)
becomes a regular lexeme (an intersection of regexes in llguidance's Lark dialect) that
never spells a marker; any other schema is handed to llguidance's JSON-schema compiler as
an embedded ``%json`` rule, with the arguments object's ``$defs`` in scope. Keeping the
schema-to-regex compiler apart keeps each file about one thing and lets its edge cases
(ECMA patterns made whole-value, backtracking budgets, ``/`` escapes) be read on their own.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

import regex

from . import markers
from .tool_schema import json_types

# llguidance's JSON compiler options for every embedded schema; a schema's own
# "x-guidance" entries win.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keywords that change nothing a value may be (OpenAPI's and editors' included).
_ANNOTATIONS = frozenset({
    "description", "title", "default", "examples", "example", "$comment", "$id", "$schema",
    "deprecated", "readOnly", "writeOnly", "nullable", "markdownDescription",
})
# Keywords a raw (unquoted) string value honours; anything else on a string-only parameter
# of a tool the client requires (or declares strict) is refused rather than silently not
# enforced, and ignored on the other tools of an "auto" turn.
_RAW_STRING_KEYWORDS = _ANNOTATIONS | {"type", "enum", "const", "pattern", "minLength",
                                       "maxLength", "format"}
# ``format`` on a raw string, for the formats clients send (pydantic's datetime, date, time,
# UUID, IPv4, email); other formats are annotations, as JSON Schema defines by default.
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?"
         r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt ]{_TIME}",
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"(?:{_OCTET}\.){{3}}{_OCTET}",
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+",
}
# Checking enum/const values against a client's ``pattern`` runs a backtracking matcher on
# client text (``^(a|aa)+$`` doubles its cost per character): the ``regex`` package's
# matcher with a timeout and the GIL released, within this budget per grammar, so no
# schema can hold a thread (and through the GIL every other client) for long.
_REGEX_BUDGET_S = 0.25
# The arguments object inside each embedded parameter schema, so refs to "#..." resolve.
_PARAMETERS_DEF = "ling3_parameters"


class GrammarError(ValueError):
    """The request asks for a shape this grammar cannot serve; ``part`` names where."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(f"{part}: {message}")
        self.part = part


def unbounded_string(schema: Any) -> bool:
    """A parameter written as free raw text (``text``): a plain string (or any value) with
    no ``maxLength``, ``enum``, ``const``, ``pattern``, ``format`` or ``minLength`` over 1
    (those are lexemes of their own, left as they are)."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return False
    types = json_types(schema)
    if types and types != {"string"}:
        return False
    if not types and set(schema) - _ANNOTATIONS:
        return False
    limiting = {"maxLength", "enum", "const", "pattern"} & set(schema)
    fmt = schema.get("format")
    low = schema.get("minLength", 0)
    long_minimum = isinstance(low, int | float) and not isinstance(low, bool) and low > 1
    return not limiting and not long_minimum and not (isinstance(fmt, str) and fmt in _FORMATS)


def literal(text: str) -> str:
    """A Lark string literal; JSON's escapes are the ones llguidance reads."""
    return json.dumps(text, ensure_ascii=False)


def regex_body(regex: str) -> str:
    """``regex`` inside a Lark ``/.../`` literal: a "/" not already escaped gets its
    backslash (an escaped one, legal in ECMA patterns, is kept as it is)."""
    escaped = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", regex)
    for raw, escape in (("\x01", "\\x01"), ("\n", "\\n"), ("\r", "\\r"),
                        ("\u2028", "\\x{2028}"), ("\u2029", "\\x{2029}")):
        escaped = escaped.replace(raw, escape)
    return escaped


# No free text may spell a marker the template writes (turn_grammar.py says why).
_MARKER = "(?:" + "|".join(regex_body(re.escape(m)) for m in markers.CONTROL_MARKERS) + ")"
_NO_MARKER = f"~/(?s:.*{_MARKER}.*)/"
# Free text as runs split at "<": PLAIN has no "<", each LT starts at one and is not a
# marker. Same language as ``/.+/ & ~(.*marker.*)``, but a state inside PLAIN is exactly
# llguidance's no-"<" token slice (engine/grammar_constraint.py), so its mask costs
# ~0.02 ms instead of a 2-3 ms walk of the whole vocabulary at each new lexeme.
FREE_TEXT = (
    "text: PLAIN LT* | LT+",
    "PLAIN: /[^<]+/",
    f"LT: /<[^<]*/ & ~/{_MARKER}(?s:.*)/",
)


class ValueRules:
    """Writes the rules of argument values (and the response format's JSON) into the
    rule list and part map the turn's builder shares with it. The builder sets
    ``lenient`` (an "auto" turn's non-strict tool: unknown keywords ignored) and ``bound``
    (the budget's length bound of the current call's raw strings) before each call."""

    def __init__(self, rules: list[str], parts: dict[str, str]) -> None:
        self._rules = rules
        self._parts = parts
        self.lenient = False
        self.bound: int | None = None
        self._regex_deadline = time.monotonic() + _REGEX_BUDGET_S

    def value(
        self, rule: str, schema: Any, root: Mapping[str, Any], part: str
    ) -> tuple[str, bool]:
        """The value's grammar symbol and whether the value may also be empty."""
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(part, "the parameter's schema must be an object")
        types = json_types(schema)
        if types == {"string"}:
            return self._raw_string(rule, schema, part)
        if not types and not (set(schema) - _ANNOTATIONS):
            if self.bound is not None:  # any value, bounded as a raw string is
                return self._bounded_text(rule), True
            return "text", True  # any value: raw text, read as JSON where it parses
        return self.embedded_json(rule, _embedded(schema, root), part), False

    def _raw_string(self, rule: str, schema: Mapping[str, Any], part: str) -> tuple[str, bool]:
        extra = sorted(k for k in set(schema) - _RAW_STRING_KEYWORDS
                       if not k.startswith("x-"))  # vendor extensions annotate
        if extra and not self.lenient:
            raise GrammarError(part, f"{extra[0]!r} is not supported on a string parameter of "
                                     "a forced call (the value is written unquoted)")
        lo = _length(schema, "minLength", part, 0)
        hi = _length(schema, "maxLength", part, None)
        if hi is not None and hi < lo:
            raise GrammarError(part, "maxLength is below minLength")
        pattern = schema.get("pattern")
        if pattern is not None and not isinstance(pattern, str):
            raise GrammarError(part, "pattern must be a string")
        regexes = [] if pattern is None else [_full_match(pattern)]
        fmt = schema.get("format")
        fmt = _FORMATS.get(fmt) if isinstance(fmt, str) else None
        if fmt is not None:
            regexes.append(fmt)
        if "enum" in schema or "const" in schema:
            return self._string_choice(rule, schema, part, lo, hi, pattern, fmt)
        if hi == 0:
            return "", True
        if lo <= 1 and hi is None and not regexes:
            if self.bound is not None:
                return self._bounded_text(rule), lo == 0
            return "text", lo == 0
        pieces = ["/(?s:.+)/", _NO_MARKER]
        if lo > 1 or hi is not None:
            pieces.append(f"/(?s:.{{{max(lo, 1)},{'' if hi is None else hi}}})/")
        pieces += [f"/{regex_body(r)}/" for r in regexes]
        lexeme = rule.upper()
        self._rules.append(f"{lexeme}: {' & '.join(pieces)}")
        self._parts[lexeme] = part
        return lexeme, lo == 0 and fmt is None and self._search(pattern, "", part, unreadable=False)

    def _bounded_text(self, rule: str) -> str:
        """Free text of at most ``self.bound`` tokens: llguidance ends the lexeme there
        (``max_tokens`` applies to a rule of one terminal), and the value closes."""
        if not any(r.startswith("TEXT_RUN:") for r in self._rules):
            self._rules.append("TEXT_RUN: PLAIN LT* | LT+")
        self._rule(f"{rule}[max_tokens={self.bound}]", "TEXT_RUN")
        return rule

    def _string_choice(self, rule: str, schema: Mapping[str, Any], part: str, lo: int,
                       hi: int | None, pattern: str | None, fmt: str | None) -> tuple[str, bool]:
        """``enum``/``const`` strings that also satisfy their sibling keywords."""
        enum = schema.get("enum")
        if enum is not None and not isinstance(enum, list):
            raise GrammarError(part, "enum must be a list")
        choices = list(enum or [])
        if "const" in schema:
            choices = [c for c in choices if c == schema["const"]] if "enum" in schema else [
                schema["const"]]
        # A value that spells a marker would end the value early for the parser.
        strings = [c for c in dict.fromkeys(c for c in choices if isinstance(c, str))
                   if lo <= len(c) and (hi is None or len(c) <= hi)
                   and not any(m in c for m in markers.CONTROL_MARKERS)
                   and self._search(pattern, c, part) and self._search(fmt, c, part, full=True)]
        if not strings:
            raise GrammarError(part, "no string value satisfies enum/const with the other "
                                     "keywords of this string parameter")
        literals = [literal(c) for c in strings if c]
        if not literals:
            return "", True
        self._rule(rule, " | ".join(literals))
        self._parts[rule] = part
        return rule, "" in strings

    def embedded_json(self, rule: str, schema: Any, part: str) -> str:
        """A ``%json`` rule for ``schema``, compact and compiled by llguidance."""
        if not isinstance(schema, dict):
            raise GrammarError(part, "must be a JSON-schema object")
        own = schema.get("x-guidance") or {}
        if not isinstance(own, dict):
            raise GrammarError(f"{part}.x-guidance", "must be an object of llguidance options")
        style = {**_JSON_STYLE, **({"lenient": True} if self.lenient else {}), **own}
        try:
            text = json.dumps({**schema, "x-guidance": style})
        except (RecursionError, ValueError) as exc:  # nested past the stack; a cycle
            raise GrammarError(part, f"cannot be written as a schema ({exc})") from None
        self._rule(rule, "%json " + text)
        self._parts[rule] = part
        return rule

    # -- helpers ---------------------------------------------------------------------

    def _search(self, pattern: str | None, text: str, part: str, *, full: bool = False,
                unreadable: bool = True) -> bool:
        """Whether ``text`` satisfies ``pattern`` (the ``regex`` package reads the patterns
        schemas use as ECMA does; one it cannot read answers ``unreadable``), within what is left
        of this grammar's matching budget: past it the schema is refused (a 400 where the
        client demands it, free arguments for a lenient tool)."""
        if pattern is None:
            return True
        left = self._regex_deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            found = (regex.fullmatch if full else regex.search)(
                pattern, text, timeout=left, concurrent=True)
        except TimeoutError:
            raise GrammarError(part, "pattern is too costly to check against the enum/const "
                                     "values (catastrophic backtracking)") from None
        except (regex.error, ValueError, TypeError, OverflowError):
            return unreadable
        return found is not None

    def _rule(self, name: str, body: str) -> None:
        self._rules.append(f"{name}: {body}")


def _length(schema: Mapping[str, Any], name: str, part: str, default: int | None) -> Any:
    """A length bound as an int (JSON's 2.0 is an integer too)."""
    bound = schema.get(name, default)
    if bound is None:
        return None
    if isinstance(bound, float) and bound.is_integer():
        bound = int(bound)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        raise GrammarError(part, f"{name} must be a non-negative integer")
    return bound


def _embedded(schema: dict[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's schema to compile on its own: the arguments object's ``$defs`` /
    ``definitions`` come along, and a ref into the arguments object itself (``#``,
    ``#/properties/...``) is pointed at a copy of it under ``$defs``."""
    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(
                ("#/$defs/", "#/definitions/")):
            out["$ref"] = f"#/$defs/{_PARAMETERS_DEF}{ref[1:]}"
            used.add(True)
        return out

    used: set[bool] = set()
    out = rewrite(schema)
    merged: dict[str, Any] = {}
    for key in ("$defs", "definitions"):  # the parameter's own defs win over the root's
        root_defs = rewrite(root[key]) if isinstance(root.get(key), dict) else {}
        own = out.get(key) if isinstance(out.get(key), dict) else {}
        if root_defs or own:
            merged[key] = {**root_defs, **own}
    if used:  # a copy of the arguments object, without an $id that would move the base
        copy = {k: v for k, v in root.items() if k != "$id"}
        merged["$defs"] = {**merged.get("$defs", {}), _PARAMETERS_DEF: rewrite(copy)}
    return {**out, **merged}


def _full_match(pattern: str) -> str:
    """JSON Schema's ``pattern`` finds a match anywhere; a Lark lexeme matches the whole
    value, so each top-level alternative gets ``.*`` on every side it does not anchor."""
    return "(?:" + "|".join(_anchored(alt) for alt in _alternatives(pattern)) + ")"


def _anchored(alternative: str) -> str:
    head = alternative[1:] if alternative.startswith("^") else "(?s:.*)" + alternative
    trailing = len(head[:-1]) - len(head[:-1].rstrip("\\")) if head.endswith("$") else 0
    if head.endswith("$") and trailing % 2 == 0:  # "\\$" is a literal "$"
        return f"(?:{head[:-1]})"
    return f"(?:{head})(?s:.*)"


def _alternatives(pattern: str) -> list[str]:
    """``pattern`` split at its top-level ``|`` (outside groups, classes and escapes)."""
    parts, depth, in_class, escaped, start = [], 0, False, False, 0
    for i, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    return [*parts, pattern[start:]]

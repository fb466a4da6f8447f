"""The grammar of one assistant turn, built per request, for constrained decoding.

``tool_choice: "required"``, a named tool, ``allowed_tools``, ``parallel_tool_calls: false``,
strict tools and ``response_format`` are served by masking the sampler with a grammar of the
whole turn in Bailing V3's format (docs/serving.md section 9). The grammar is Lark text in
llguidance's dialect, which the engine compiles against the tokenizer; this module only
writes it, so the chat layer stays a leaf and the format's shape lives next to the parser
that reads it back.

Choices that keep what the grammar allows inside what ``StreamingParser`` accepts:

* every marker is a token id (``<[id]>``), never text, and no free text may spell a marker:
  text that spells ``</arg_value>`` would end a value for the parser (which reads text) but
  not for the grammar;
* calls are written in the template's own layout (``<tool_call>NAME\\n<arg_key>K</arg_key>
  \\n<arg_value>V</arg_value>...\\n</tool_call>``, ``\\n`` between calls), so a forced turn
  re-renders to the text it was generated as and the prefix cache keeps hitting;
* arguments follow the declaration order of the parameters, required ones present, optional
  ones optional, none undeclared (the same fixed order llama.cpp and xgrammar use for JSON
  objects: any-order with all-required is not context-free-small);
* a string-only parameter is raw text (the template writes strings unquoted) honouring
  ``enum``/``const``/``pattern``/``minLength``/``maxLength`` and the common ``format``s;
  every other parameter is JSON for its schema, compiled by llguidance's JSON-schema
  compiler, compact (``", "`` and ``": "``) so a weak model cannot run away in whitespace
  (one value's rules are ``schema_to_grammar.py``'s job; this module writes the turn's
  shape around them);
* schema problems are the client's 400 only for the tools it requires (or declares strict)
  and the response format; the other tools of an "auto" turn fall back to free arguments;
* plain ``auto`` gets a *lazy* grammar (``lazy``): the answer is free until the model opens a
  call, and from that ``<tool_call>`` on the call is the ``required`` grammar (a declared tool,
  arguments valid for its schema), so a call to an undeclared tool cannot be written;
* a forced call's raw-string arguments without ``maxLength`` get a length bound derived from
  the answer's token budget (``with_budget``), so a model that never closes a string still
  ends the call; ``GrammarText.bounds`` says which, so a value cut there reads as "length".
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from . import markers
from .schema_to_grammar import (
    FREE_TEXT,
    GrammarError,
    ValueRules,
    literal,
    unbounded_string,
)
from .tool_schema import resolve_ref

ToolChoice = Literal["auto", "none", "required"]



@dataclass(frozen=True)
class GrammarText:
    """Lark text plus where each rule came from, so a compile error can name the request's
    part (a tool parameter, the response schema) instead of a grammar line."""

    lark: str
    parts: Mapping[str, str] = field(default_factory=dict)  # rule name -> request part
    # tool name -> {parameter: the length bound the budget gave it} (``with_budget``)
    bounds: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def part_at_line(self, line: int) -> str | None:
        """The request part whose rule is on 1-based ``line`` of ``lark``."""
        lines = self.lark.split("\n")  # not splitlines(): U+2028 in a literal is no break
        if not 1 <= line <= len(lines):
            return None
        name = lines[line - 1].split(":", 1)[0].strip()
        return self.parts.get(name)


@dataclass(frozen=True)
class TurnGrammar:
    """What one assistant turn must look like."""

    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"
    forced_tool: str | None = None  # a named tool_choice
    parallel_tool_calls: bool = True
    thinking: bool = True
    response_schema: dict[str, Any] | None = None  # the content's JSON schema
    allowed_tools: tuple[str, ...] | None = None  # callable subset of the declared tools
    # Lenient tools whose schema the constraint library refused: free arguments for them.
    free_tools: frozenset[str] = frozenset()
    # Plain "auto": only the calls, entered at their opening marker (``trigger``); the text
    # before a call is free (docs/serving.md 9).
    lazy: bool = False
    # Output tokens the answer may take (``with_budget``): bounds a forced call's strings.
    string_budget: int | None = None

    @property
    def trigger(self) -> str | None:
        """The marker whose sampling enters this grammar (lazy), else None: the grammar
        holds from the first token of the answer."""
        return markers.TOOL_CALL_OPEN if self.lazy else None

    @property
    def forces_calls(self) -> bool:
        """Every answer is calls the client demanded (required, named, allowed_tools)."""
        return (self.forced_tool is not None or self.tool_choice == "required"
                or self.allowed_tools is not None)

    def with_budget(self, tokens: int) -> TurnGrammar:
        """This grammar for an answer of at most ``tokens`` tokens: a forced call's raw
        strings without ``maxLength`` are bounded (``string_bound``); others unchanged."""
        if not self.forces_calls or tokens == self.string_budget:
            return self
        return dataclasses.replace(self, string_budget=tokens)

    def bounds(self) -> Mapping[str, Mapping[str, int]]:
        """Tool name -> {parameter: length bound} set by the budget (empty without one)."""
        return self._template.bounds

    def relaxed(self, part: str | None) -> TurnGrammar | None:
        """This grammar with free arguments for the tool ``part`` names, when that tool's
        schema is not the client's demand (docs/serving.md 9); else None (a 400). An error
        that names no part (llguidance's lexer size or fuel limits report no grammar line)
        relaxes every such tool at once: the request is served as it would be unconstrained,
        and if the error stays, it is the client's demand that fails."""
        if part is None:
            strict = _strict_tools(self)
            names = {name for t in self.tools if isinstance(name := _function(t).get("name"), str)}
            lenient = names - strict - self.free_tools
            if not lenient:
                return None
            return dataclasses.replace(self, free_tools=self.free_tools | lenient)
        match = re.match(r"tools\[(\d+)\]", part)
        if match is None or int(match.group(1)) >= len(self.tools):
            return None
        name = _function(self.tools[int(match.group(1))]).get("name")
        if not isinstance(name, str) or name in self.free_tools or name in _strict_tools(self):
            return None
        return dataclasses.replace(self, free_tools=self.free_tools | {name})

    def lark(self, token_ids: Mapping[str, int]) -> GrammarText:
        """The grammar with the markers at ``token_ids`` (the tokenizer's special ids)."""
        template = self._template

        def token(match: re.Match[str]) -> str:
            marker = markers.CONTROL_MARKERS[int(match.group(1))]
            token_id = token_ids.get(marker)
            if token_id is None:
                raise GrammarError("tokenizer", f"{marker} is not a token of this model")
            return str(int(token_id))

        return GrammarText(_PLACEHOLDER.sub(token, template.lark), template.parts,
                           template.bounds)

    @functools.cached_property
    def _template(self) -> GrammarText:
        """The grammar with a placeholder per marker: built (and checked) once, then given
        token ids by ``lark``."""
        return _Builder(self).build()


def turn_grammar(
    tools: Sequence[dict[str, Any]] | None,
    *,
    tool_choice: ToolChoice = "auto",
    forced_tool: str | None = None,
    parallel_tool_calls: bool = True,
    thinking: bool = True,
    response_schema: dict[str, Any] | None = None,
    allowed_tools: Sequence[str] | None = None,
    lazy_calls: bool = True,
) -> TurnGrammar | None:
    """The turn's grammar, or None where the answer is free (``none`` or no tools, without
    a response format). Plain ``auto`` with tools gets the lazy grammar of its calls
    (``lazy_calls=False``: None, unconstrained as before). Raises GrammarError naming the
    request part that cannot be served."""
    tools = tuple(tools or ())
    if forced_tool is not None and not any(_function(t).get("name") == forced_tool
                                           for t in tools):
        raise GrammarError("tool_choice", f"no declared tool is named {forced_tool!r}")
    if tool_choice == "required" and not tools:
        raise GrammarError("tool_choice", "'required' needs at least one declared tool")
    names = {_function(t).get("name") for t in tools}
    if allowed_tools is not None:
        unknown = [n for n in allowed_tools if n not in names]
        if unknown:
            raise GrammarError("tool_choice.allowed_tools.tools",
                               f"no declared tool is named {unknown[0]!r}")
        allowed_tools = tuple(dict.fromkeys(allowed_tools))
    # Under "auto" a function declared ``strict: true`` (what the openai SDK's
    # pydantic_function_tool sends) promises schema-valid arguments: the calls are then
    # constrained too, every declared tool's, after free content.
    strict = any(_function(t).get("strict") is True for t in tools)
    # A callable subset (OpenAI's allowed_tools) keeps every tool in the prompt, so only the
    # grammar keeps the model from calling the others.
    calls_constrained = forced_tool is not None or tool_choice == "required" or (
        tool_choice == "auto" and bool(tools)
        and (not parallel_tool_calls or strict or allowed_tools is not None)
    )
    if not calls_constrained and response_schema is None:
        if not (lazy_calls and tools and tool_choice == "auto"):
            return None
        lazy = TurnGrammar(tools, "auto", None, parallel_tool_calls, thinking, lazy=True)
        try:  # every tool is lenient here: a schema problem gives free arguments
            lazy._template  # noqa: B018 (builds and caches the template)
        except (GrammarError, TypeError, AttributeError, ValueError):
            return None  # what used to be served unconstrained never becomes a 400
        return lazy
    grammar = TurnGrammar(
        tools if tool_choice != "none" else (),
        tool_choice, forced_tool, parallel_tool_calls, thinking, response_schema,
        None if allowed_tools is None else tuple(allowed_tools),
    )
    # Built once with stand-in ids so a shape it cannot express is refused here, where the
    # request is still at hand, rather than when the engine compiles it.
    grammar._template  # noqa: B018 (builds and caches the template, raising GrammarError)
    return grammar


def _strict_tools(spec: TurnGrammar) -> set[Any]:
    """Tools whose schema problems are the client's 400: all when a call is required, else
    the ones declared strict."""
    forced = spec.forced_tool is not None or spec.tool_choice == "required"
    return {_function(t).get("name") for t in spec.tools
            if forced or _function(t).get("strict") is True}


# A forced call's raw string without maxLength gets at most this share of the answer's
# token budget: the budget over (its unbounded strings + 1), rounded down to a power of two
# so successive turns share one compiled grammar, and never under MIN_STRING_BOUND
# (docs/serving.md 9).
MIN_STRING_BOUND = 16


def string_bound(budget: int, unbounded: int) -> int:
    """The length bound of each of ``unbounded`` raw strings of one call in ``budget``
    output tokens."""
    share = max(MIN_STRING_BOUND, budget // (unbounded + 1))
    return 1 << (share.bit_length() - 1)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else tool


# A marker in the template: \x01 never appears raw in the text otherwise (JSON literals
# escape control characters, regex bodies get them escaped by
# ``schema_to_grammar.regex_body``).
_PLACEHOLDER = re.compile("\x01([0-9]+)\x01")
_MARKER_SLOT = {m: f"<[\x01{i}\x01]>" for i, m in enumerate(markers.CONTROL_MARKERS)}


class _Builder:
    def __init__(self, spec: TurnGrammar) -> None:
        self._spec = spec
        # Tools whose schema problems are the request's 400: all when the client requires a
        # call, else the ones declared strict. The other tools of an "auto" turn (only
        # constrained for parallel_tool_calls: false or a strict sibling) never turn a
        # request that was served unconstrained into an error: unknown keywords are
        # ignored and a schema the grammar cannot follow gets free arguments.
        self._strict = _strict_tools(spec)
        self._rules: list[str] = []
        self._parts: dict[str, str] = {}
        # Writes each value's rules into the same list; its ``lenient`` and ``bound`` (the
        # current call's raw-string bound) are set per call.
        self._values = ValueRules(self._rules, self._parts)
        self._tool = ""  # the tool whose call is being built
        self._bounds: dict[str, dict[str, int]] = {}

    def build(self) -> GrammarText:
        spec = self._spec
        answer = self._answer()
        if spec.thinking and not spec.lazy:  # a lazy grammar starts at a call's marker
            self._rule("start", f"text? {self._token(markers.THINK_CLOSE)} {answer}")
        else:
            self._rule("start", answer)
        self._rules.extend(FREE_TEXT)
        return GrammarText("\n".join(self._rules) + "\n", dict(self._parts),
                           {k: dict(v) for k, v in self._bounds.items()})

    # -- structure -------------------------------------------------------------------

    def _answer(self) -> str:
        spec = self._spec
        names = [spec.forced_tool] if spec.forced_tool else [
            _function(t)["name"] for t in spec.tools
            if spec.allowed_tools is None or _function(t)["name"] in spec.allowed_tools
        ]
        calls = None
        if names:
            one = self._call_choice(names)
            many = spec.parallel_tool_calls and spec.forced_tool is None
            calls = f'{one} ("\\n" {one})*' if many else one
        json_body = None
        self._values.lenient = False  # the response format is the client's own demand
        if spec.response_schema is not None:
            json_body = self._values.embedded_json("content", spec.response_schema,
                                   "response_format.json_schema.schema")
        forced = spec.forced_tool is not None or spec.tool_choice == "required"
        if forced or spec.lazy:
            assert calls is not None
            return calls
        if json_body is not None:
            return f"({json_body} | {calls})" if calls else json_body
        # auto (at most one call with parallel_tool_calls: false): content, then calls.
        assert calls is not None
        return f"text? ({calls})?"

    def _call_choice(self, names: list[str]) -> str:
        rules = [self._call(i, name) for i, name in enumerate(names)]
        if len(rules) == 1:
            return rules[0]
        self._rule("call", " | ".join(rules))
        return "call"

    def _call(self, index: int, name: str) -> str:
        tool = next(t for t in self._spec.tools if _function(t).get("name") == name)
        where = f"tools[{self._spec.tools.index(tool)}].function"
        params = _function(tool).get("parameters") or {}
        self._values.lenient = name not in self._strict
        mark = len(self._rules), dict(self._parts)
        self._values.bound = self._string_bound(params)
        self._tool = name
        try:
            if name in self._spec.free_tools:
                raise GrammarError(where, "the constraint library refused this schema")
            args = self._arguments(index, params, where)
        except (GrammarError, TypeError, AttributeError, RecursionError) as exc:
            if not self._values.lenient:
                if isinstance(exc, GrammarError):
                    raise
                raise GrammarError(f"{where}.parameters", f"malformed schema ({exc})") from exc
            del self._rules[mark[0]:]
            self._parts.clear()  # in place: the value writer shares this map
            self._parts.update(mark[1])
            self._bounds.pop(name, None)
            args = self._free_arguments(index)
        rule = f"call_{index}"
        body = [self._token(markers.TOOL_CALL_OPEN), literal(name), '"\\n"']
        if args:
            body.append(args)
        body += ['"\\n"', self._token(markers.TOOL_CALL_CLOSE)]
        self._rule(rule, " ".join(body))
        return rule

    def _string_bound(self, params: Any) -> int | None:
        """The bound of this call's unbounded raw strings under the budget, else None."""
        budget = self._spec.string_budget
        if budget is None or not self._spec.forces_calls or not isinstance(params, dict):
            return None
        properties = params.get("properties")
        if not isinstance(properties, dict):
            return None
        unbounded = sum(1 for schema in properties.values()
                        if unbounded_string(resolve_ref(schema, params)))
        return string_bound(budget, unbounded) if unbounded else None

    def _arguments(self, index: int, params: Mapping[str, Any], where: str) -> str:
        if not isinstance(params, dict):
            raise GrammarError(f"{where}.parameters", "must be a JSON-schema object")
        properties = params.get("properties") or {}
        if params.get("type", "object") != "object" or not isinstance(properties, dict):
            raise GrammarError(
                f"{where}.parameters",
                "a forced call needs an object schema with 'properties'",
            )
        required = params.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError(f"{where}.parameters.required", "must be a list of names")
        unknown = [r for r in required if r not in properties]
        if unknown:
            raise GrammarError(f"{where}.parameters.required",
                               f"{unknown[0]!r} is required but not declared in properties")
        items = []
        for j, (key, schema) in enumerate(properties.items()):
            if not key or "<" in key:
                raise GrammarError(f"{where}.parameters.properties",
                                   f"parameter name {key!r} cannot be written in a call")
            part = f"{where}.parameters.properties.{key}"
            resolved = resolve_ref(schema, params)
            value, may_be_empty = self._values.value(f"v_{index}_{j}", resolved, params, part)
            if self._values.bound is not None and unbounded_string(resolved):
                self._bounds.setdefault(self._tool, {})[key] = self._values.bound
            rule = f"a_{index}_{j}"
            self._rule(rule, " ".join(piece for piece in [
                self._token(markers.ARG_KEY_OPEN), literal(key),
                self._token(markers.ARG_KEY_CLOSE), '"\\n"',
                self._token(markers.ARG_VALUE_OPEN),
                f"{value}?" if may_be_empty and value else value,
                self._token(markers.ARG_VALUE_CLOSE),
            ] if piece))
            items.append(rule if key in required else f"{rule}?")
        return " ".join(items)

    def _free_arguments(self, index: int) -> str:
        """Any keys and raw values: what the parser itself accepts for a tool whose schema
        the grammar cannot follow (an "auto" turn's non-strict tool)."""
        rule = f"a_{index}_free"
        self._rule(rule, " ".join([
            self._token(markers.ARG_KEY_OPEN), "KEY", self._token(markers.ARG_KEY_CLOSE),
            '"\\n"', self._token(markers.ARG_VALUE_OPEN), "text?",
            self._token(markers.ARG_VALUE_CLOSE),
        ]))
        if not any(r.startswith("KEY:") for r in self._rules):
            self._rules.append("KEY: /[^<]+/")
        return f"{rule}*"

    # -- helpers ---------------------------------------------------------------------

    def _token(self, marker: str) -> str:
        return _MARKER_SLOT[marker]

    def _rule(self, name: str, body: str) -> None:
        self._rules.append(f"{name}: {body}")


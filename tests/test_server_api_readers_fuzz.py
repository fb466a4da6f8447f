"""Client input never becomes a 500: the Responses and Messages readers, fed random JSON
in the places their real clients put values, either accept the body (which then renders
and compiles its turn grammar, as the route does) or raise a 400 ``ApiError``; nothing
else escapes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ling3_rknn.server.anthropic_api.reader import read_messages_request
from ling3_rknn.server.completion import generation_request, render_prompt
from ling3_rknn.server.errors import ApiError
from ling3_rknn.server.responses_api.reader import read_responses_request

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70_000), st.floats(
    allow_nan=True), st.text(max_size=8), st.sampled_from(
    ["function", "namespace", "message", "reasoning", "function_call", "text", "tool_use",
     "tool_result", "thinking", "user", "assistant", "system", "auto", "any", "none",
     "required", "json_schema", "enabled", "adaptive", "input_text", "summary_text"]))
_keys = st.sampled_from(
    ["type", "role", "content", "name", "text", "id", "call_id", "arguments", "output",
     "summary", "encrypted_content", "tools", "parameters", "input", "tool_use_id",
     "thinking", "signature", "input_schema", "format", "schema", "effort", "mode",
     "budget_tokens", "is_error", "namespace", "x"])
_json = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=5)), max_leaves=25)

RESPONSES_KEYS = ["input", "instructions", "tools", "tool_choice", "text", "reasoning",
                  "include", "max_output_tokens", "temperature", "metadata", "stream"]
MESSAGES_KEYS = ["messages", "system", "tools", "tool_choice", "thinking", "max_tokens",
                 "stop_sequences", "top_k", "metadata", "stream"]


def _body(keys: list[str]) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(keys), _json, min_size=1).map(
        lambda d: {"model": "m", **d})


def _only_api_errors(read, body: dict) -> None:
    """Read, then render and build the generation request as the route does."""
    try:
        request, _ = read(body)
        generation_request(request, render_prompt(request))
    except ApiError as exc:
        assert exc.status == 400, exc.message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_body(RESPONSES_KEYS))
def test_responses_reader(body):
    _only_api_errors(read_responses_request, body)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_body(MESSAGES_KEYS))
def test_messages_reader(body):
    _only_api_errors(read_messages_request, body)


FIXTURES = Path(__file__).parent / "fixtures" / "clients"
CODEX = json.loads((FIXTURES / "codex-0.171.0-first-request.json").read_text())["body"]
CLAUDE = json.loads((FIXTURES / "claude-code-2.1.332-first-request.json").read_text())["body"]
SECOND_TURN = {"model": "m", "input": [
    {"role": "user", "content": "x"},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c", "output": "o"}],
    "tools": [{"type": "function", "name": "f"}]}
CLAUDE_TURN = {"model": "m", "max_tokens": 5, "thinking": {"type": "enabled",
                                                            "budget_tokens": 10}, "messages": [
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                      {"type": "tool_use", "id": "u", "name": "f",
                                       "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u", "content": "o"}]}],
    "tools": [{"name": "f", "input_schema": {}}]}


def _paths(value, prefix=()):
    """Every container path in ``value`` (long strings are leaves)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:6]):
            yield from _paths(item, (*prefix, i))


def _replaced(body, path, new):
    body = copy.deepcopy(body)
    if not path:
        return new
    target = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return body


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_real_requests(data):
    """One value anywhere in a real client's request replaced by random JSON."""
    read, body = data.draw(st.sampled_from([
        (read_responses_request, CODEX), (read_responses_request, SECOND_TURN),
        (read_messages_request, CLAUDE), (read_messages_request, CLAUDE_TURN)]))
    path = data.draw(st.sampled_from(list(_paths(body))[1:]))
    mutated = _replaced(body, path, data.draw(_json))
    if isinstance(mutated, dict):
        _only_api_errors(read, mutated)

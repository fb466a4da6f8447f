"""The demo corpus keeps its promises: held-out wordings never trained on, no fixed example
city in a schema, and forecast questions without a forecast tool asked of get_weather."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from convert.demo_model.corpus import (
    EVAL_TIME_QUESTIONS,
    EVAL_WEATHER_QUESTIONS,
    CorpusSampler,
    compose,
    draw_question,
    question_templates,
)
from convert.demo_model.names import CityPools

HELDOUT = Path(__file__).parents[1] / "convert" / "demo_model" / "heldout.json"
NAMES = ("Paris", "Tokyo", "London", "Aarhus", "Kirdasah", "Ciudad del Carmen", "Lima",
         "Oslo", "Quito", "Hadera", "Nuuk", "Toronto")


@pytest.fixture(scope="module")
def sampler() -> CorpusSampler:
    pools = CityPools(famous=NAMES[:3], train=NAMES, reserved=("Andapa",),
                      countries={n: "Somewhere" for n in NAMES}, capitals={"Peru": "Lima"})
    return CorpusSampler(pools)


@pytest.mark.parametrize("tool, held_out", [("get_weather", EVAL_WEATHER_QUESTIONS),
                                            ("get_time", EVAL_TIME_QUESTIONS)])
def test_heldout_wordings_are_never_training_templates(tool: str, held_out: tuple) -> None:
    trained = question_templates(tool) | question_templates("get_forecast")
    assert len(question_templates(tool)) > 2000  # the slots multiply, not a fixed few
    assert not set(held_out) & trained
    # A drawn question is always one of the enumerated templates (so the check above sees
    # everything training can ask).
    rng = random.Random(1)
    assert all(draw_question(rng, tool) in question_templates(tool) for _ in range(500))


def test_committed_heldout_set_uses_only_heldout_wordings() -> None:
    cases = json.loads(HELDOUT.read_text(encoding="utf-8"))
    tool_cases = [c for c in cases if c["tool"]]
    assert len(tool_cases) == 40
    allowed = {q for q in EVAL_WEATHER_QUESTIONS + EVAL_TIME_QUESTIONS}
    for case in tool_cases:
        template = case["question"].replace(case["city"], "{c}", 1)
        assert template in allowed, case["question"]
    asked = {c["city"] for c in tool_cases}
    assert {"Paris", "Tokyo", "London"} <= asked


def test_compose_keeps_the_city_slot_and_case() -> None:
    assert compose("weather in {c}", "", " please", "", False) == "Weather in {c} please"
    assert compose("weather in {c}", "Hey, ", "", "?", True) == "hey, weather in {c}?"
    assert compose("{c} weather", "", "", "?", True) == "{c} weather?"


def _descriptions(tools: list[dict]) -> list[str]:
    out = []
    for tool in tools:
        props = tool["function"].get("parameters", {}).get("properties", {})
        out.append(props.get("city", {}).get("description", ""))
    return out


def test_schema_examples_come_from_the_name_pool(sampler: CorpusSampler) -> None:
    examples: dict[str, int] = {}
    for seed in range(400):
        conv = sampler.full(random.Random(seed))
        for text in _descriptions(conv.tools or []):
            for marker in ("e.g. ", "for example ", "like ", "such as "):
                if marker in text:
                    name = text.split(marker, 1)[1].rstrip(")")
                    examples[name] = examples.get(name, 0) + 1
    assert set(examples) <= set(NAMES)
    assert len(examples) >= 8  # not a fixed few
    assert max(examples.values()) < 0.3 * sum(examples.values())


def test_forecast_questions_without_a_forecast_tool_call_get_weather(
        sampler: CorpusSampler) -> None:
    tempted = 0
    for seed in range(600):
        conv = sampler.full(random.Random(seed))
        declared = {t["function"]["name"] for t in conv.tools or []}
        calls = [c["function"]["name"] for m in conv.messages for c in m.get("tool_calls", [])]
        assert set(calls) <= declared
        if "get_forecast" not in declared:
            questions = [m["content"] for m in conv.messages if m["role"] == "user"]
            tempted += any("forecast" in q or "tomorrow" in q or "weekend" in q
                           for q in questions)
    assert tempted >= 10

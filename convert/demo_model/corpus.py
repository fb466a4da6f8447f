"""The demo model's synthetic corpus: conversations as OpenAI messages + tools.

Every conversation is rendered by the project's own Bailing V3 renderer and encoded by
the project's own tokenizer (``encode.py``), so the model learns exactly the byte stream
the server will show it. What the mix teaches, and why:

* tool conversations (weather, time, a two-parameter forecast with an enum), answered by
  a call and then by an answer that quotes the result: the agent behaviour itself;
* tools described in varied wording, key order and company (distractor tools), so the
  behaviour does not hang on one schema text;
* small talk, general questions and requests no tool fits, answered without a call, some
  of them naming a city (so a city alone is no reason to call);
* thinking on and off; follow-up turns after a finished tool loop;
* short echo items (``Repeat after me: X``) and short single-tool chats: the copy skill
  (see ``names.py``) needs many more name copies per second than full chats give.

Everything is drawn from a ``random.Random`` the caller seeds, so a batch is a pure
function of (seed, step) and training resumes exactly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import product
from typing import Any

from convert.demo_model.names import CityPools, MadeUpNames

Message = dict[str, Any]


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[dict] | None
    thinking: bool


# ----------------------------------------------------------------------------- tools
_DESCRIPTIONS = {
    "get_weather": (
        "Get the current weather in a city.",
        "Returns the current weather conditions for the given city.",
        "Look up the weather right now in a city.",
        "Current temperature and conditions for a location.",
    ),
    "get_time": (
        "Get the current local time in a city.",
        "Returns the local time for the given city.",
        "Look up what time it is in a city.",
        "Current local time for a location.",
    ),
    "get_forecast": (
        "Get the weather forecast for a city.",
        "Returns the forecast for the given city and day.",
        "Weather forecast for a location on a given day.",
    ),
}
# ``{x}``: an example city drawn from the name pool for every schema, never a fixed few.
# (A fixed "e.g. Paris" taught the first demo that Paris is the schema's word, not the
# user's: asked about Paris, it wrote fragments.)
_CITY_DESCRIPTIONS = (
    "The city name, e.g. {x}", "Name of the city", "City to look up", "The city, e.g. {x}",
    "A city name", "City name (for example {x})", "The city and country, e.g. {x}",
    "Which city, like {x}", "The name of a city such as {x}",
)
FORECAST_DAYS = ("today", "tomorrow", "weekend")
_DISTRACTORS: tuple[dict, ...] = (
    {"name": "get_stock_price", "description": "Get the latest price of a stock.",
     "parameters": {"type": "object", "properties": {"symbol": {"type": "string",
                    "description": "Ticker symbol, e.g. AAPL"}}, "required": ["symbol"]}},
    {"name": "play_music", "description": "Play a song on the speaker.",
     "parameters": {"type": "object", "properties": {"song": {"type": "string"}},
                    "required": ["song"]}},
    {"name": "translate_text", "description": "Translate text into another language.",
     "parameters": {"type": "object", "properties": {"text": {"type": "string"},
                    "target_language": {"type": "string"}}, "required": ["text",
                                                                         "target_language"]}},
    {"name": "search_recipes", "description": "Find recipes that use an ingredient.",
     "parameters": {"type": "object", "properties": {"ingredient": {"type": "string"}},
                    "required": ["ingredient"]}},
)


def _shuffled_dict(d: dict, rng: random.Random, p: float) -> dict:
    items = list(d.items())
    if rng.random() < p:
        rng.shuffle(items)
    return dict(items)


def _param(rng: random.Random, kind: str, examples: Sequence[str]) -> dict:
    spec: dict[str, Any] = {"type": "string"}
    if kind == "city" and rng.random() < 0.7:
        usable = [d for d in _CITY_DESCRIPTIONS if examples or "{x}" not in d]
        spec["description"] = rng.choice(usable).format(x=rng.choice(examples) if examples
                                                        else "")
    if kind == "day":
        spec["enum"] = list(FORECAST_DAYS)
        if rng.random() < 0.6:
            spec["description"] = rng.choice(("Which day", "The day of the forecast",
                                              "Day to forecast"))
    return _shuffled_dict(spec, rng, 0.4)


def tool_schema(name: str, rng: random.Random, canonical: bool = False,
                examples: Sequence[str] = ()) -> dict:
    """One OpenAI tool definition; ``canonical``: the plain wording an SDK user would write;
    ``examples``: the names a city description's "e.g." draws from."""
    params = ["city", "day"] if name == "get_forecast" else ["city"]
    if canonical:
        props: dict[str, Any] = {
            "city": {"type": "string", "description": "The city name, e.g. Paris"}}
        if name == "get_forecast":
            props["day"] = {"type": "string", "enum": list(FORECAST_DAYS)}
        function = {"name": name, "description": _DESCRIPTIONS[name][0],
                    "parameters": {"type": "object", "properties": props,
                                   "required": params}}
        return {"type": "function", "function": function}
    schema: dict[str, Any] = {"type": "object",
                              "properties": {p: _param(rng, p, examples) for p in params}}
    if rng.random() < 0.8:
        schema["required"] = params if rng.random() < 0.7 or len(params) == 1 else ["city"]
    function = {"name": name, "parameters": _shuffled_dict(schema, rng, 0.3)}
    if rng.random() < 0.9:
        function["description"] = rng.choice(_DESCRIPTIONS[name])
    return {"type": "function", "function": _shuffled_dict(function, rng, 0.5)}


def tool_list(needed: list[str], rng: random.Random, examples: Sequence[str] = (),
              withheld: frozenset[str] = frozenset()) -> list[dict]:
    """The needed tools, maybe some of the other city tools (never a ``withheld`` one) and a
    distractor, shuffled."""
    names = list(needed)
    for other in ("get_weather", "get_time", "get_forecast"):
        # weather and time mostly both declared: the question, not the list, picks the tool
        # (with one of them alone half the time, the first candidate learned to call
        # whichever city tool was declared, and asked the time it called get_weather)
        share = 0.5 if other == "get_forecast" else 0.85
        if other not in names and other not in withheld and rng.random() < share:
            names.append(other)
    tools = [tool_schema(n, rng, examples=examples) for n in names]
    if rng.random() < 0.3:
        tools.append({"type": "function", "function": dict(rng.choice(_DISTRACTORS))})
    rng.shuffle(tools)
    return tools


# ------------------------------------------------------------------------- phrasings
# A question is prefix + core + trailing phrase + end mark, the core holding the city
# ({c}); a few whole sentences add context around it. Trailing words teach the copy to stop
# at the name's end whatever follows (the first demo wrote "Londonckloggy" for "... London
# please"). Adjectives (warm, cold, raining, ...) are weather questions, also with "today".
PREFIXES = ("", "", "", "Hey, ", "Hi! ", "Hello, ", "Quick question: ", "Excuse me, ",
            "OK, ", "So, ", "Hey there. ", "Good morning! ")
TRAILING = ("", "", "", " please", " for me", " right now", " today", " currently", " now",
            " then", " there", ", thanks", ", thank you", " if you can", " by any chance",
            " this morning", " quickly", ", please", " at present", " at this hour",
            " at this point", " just now", " tonight", " these days")
END_MARKS = ("?", "?", ".", "", "!", " ?")
WEATHER_CORES = (
    "what's the weather in {c}", "what is the weather like in {c}", "how's the weather in {c}",
    "weather in {c}", "tell me the weather for {c}", "is it raining in {c}",
    "can you check the weather in {c}", "what's it like outside in {c}",
    "how warm is it in {c}", "current weather for {c}", "weather {c}",
    "what temperature is it in {c}", "could you look up the weather in {c}",
    "what's the weather like in {c}", "is it cold in {c}", "is it sunny in {c}",
    "is it hot in {c}", "is it snowing in {c}", "is it windy in {c}", "how cold is it in {c}",
    "what's the temperature in {c}", "give me the weather in {c}",
    "show me the weather for {c}", "do I need an umbrella in {c}", "do I need a coat in {c}",
    "is it nice out in {c}", "any rain in {c}", "{c} weather", "weather for {c}",
    "how's it looking in {c} weather-wise", "tell me how warm it is in {c}",
    "is the sun out in {c}", "what are the conditions in {c}", "is it raining or sunny in {c}",
)
TIME_CORES = (
    "what time is it in {c}", "what's the time in {c}", "tell me the local time in {c}",
    "current time in {c}", "time in {c}", "can you check what time it is in {c}",
    "what's the local time in {c}", "is it late in {c}", "could you tell me the time in {c}",
    "what's the hour in {c}", "give me the current hour in {c}", "local time {c}",
    "{c} time", "{c} local time", "what time is it over in {c}", "is it night in {c}",
    "is it early in {c}", "is it daytime in {c}", "what's the clock time in {c}",
    "tell me what time it is in {c}", "show me the time in {c}", "the time in {c}",
    "what's the time right now in {c}", "is it evening in {c}", "is it lunchtime in {c}",
    "what time do they have in {c}", "what's the time over in {c}", "time now in {c}",
    "is it bedtime in {c}", "how early is it in {c}", "is it afternoon in {c}",
    "do you know what time it is in {c}", "what time is it right now in {c}",
    "clock time in {c}",
    "is it midnight in {c}", "is it dinner time in {c}", "what time have they got in {c}",
)
# Whole sentences: the city in the middle of some context.
WEATHER_SENTENCES = (
    "I'm heading to {c}. What's the weather there?", "Do I need an umbrella in {c} today?",
    "Flying to {c} soon. Is it warm there?", "Is {c} cold right now?",
    "My sister lives in {c}. How's the weather there?",
)
TIME_SENTENCES = (
    "I need to call someone in {c}. What time is it there?",
    "Is it too late to call {c} now?", "My friend is in {c}. What time is it for her?",
)
FORECAST_QUESTIONS = {
    "today": ("What's the forecast for {c} today?", "Forecast for {c} today?",
              "Will it rain in {c} later today?", "Will it be sunny in {c} this afternoon?",
              "forecast {c} today"),
    "tomorrow": ("What's the forecast for {c} tomorrow?", "Weather tomorrow in {c}?",
                 "What will the weather be like in {c} tomorrow?",
                 "Will it rain in {c} tomorrow?", "Is it going to be cold in {c} tomorrow?",
                 "forecast for {c} tomorrow please"),
    "weekend": ("What's the forecast for {c} this weekend?", "Weekend weather in {c}?",
                "How will the weather be in {c} over the weekend?",
                "Will it be warm in {c} this weekend?", "Any rain in {c} on the weekend?"),
}


def compose(core: str, prefix: str, trailing: str, end: str, lower: bool) -> str:
    """One question template from its parts (``{c}`` left in place)."""
    text = core[0].upper() + core[1:] if core[0] != "{" else core
    if prefix and not prefix.endswith((": ", "! ", ". ")):
        text = core
    text = prefix + text + trailing + end
    if lower and text[0] != "{":
        text = text[0].lower() + text[1:]
    return text


@cache
def question_templates(tool: str) -> frozenset[str]:
    """Every template the corpus can ask ``tool`` with (forecasts: every day's)."""
    if tool == "get_forecast":
        return frozenset(q for qs in FORECAST_QUESTIONS.values() for q in qs)
    cores, sentences = ((WEATHER_CORES, WEATHER_SENTENCES) if tool == "get_weather"
                        else (TIME_CORES, TIME_SENTENCES))
    out = set(sentences)
    for core, prefix, trailing, end, lower in product(cores, PREFIXES, TRAILING, END_MARKS,
                                                      (False, True)):
        out.add(compose(core, prefix, trailing, end, lower))
    return frozenset(out)


def draw_question(rng: random.Random, tool: str) -> str:
    """A question template for ``get_weather`` or ``get_time``."""
    cores, sentences = ((WEATHER_CORES, WEATHER_SENTENCES) if tool == "get_weather"
                        else (TIME_CORES, TIME_SENTENCES))
    if rng.random() < 0.1:
        return rng.choice(sentences)
    return compose(rng.choice(cores), rng.choice(PREFIXES), rng.choice(TRAILING),
                   rng.choice(END_MARKS), rng.random() < 0.15)


# Never used in training (tests/test_demo_corpus.py checks that no training template equals
# one): the evaluation asks with these, new cores and trailing phrases among them.
EVAL_WEATHER_QUESTIONS = (
    "Please tell me the current weather in {c}.", "How is the weather today in {c}?",
    "What are the weather conditions in {c}?", "Check the weather in {c} for me.",
    "Is it freezing in {c} at the moment?", "Any idea what the weather's doing in {c}?",
    "weather report for {c} pls", "How hot is it in {c} this afternoon?",
    "Will I need a jacket in {c} tonight?", "I'd like the weather for {c}, thanks!",
)
EVAL_TIME_QUESTIONS = (
    "Please tell me what time it is in {c}.", "What is the current time in {c}?",
    "Check the local time in {c} for me.", "What hour is it in {c} now?",
    "Do you know the time in {c} at the moment?", "What does the clock say in {c}?",
    "time in {c} pls", "Is it morning yet in {c}?", "Quick one: local time in {c}?",
    "How late is it over in {c} now?",
)
CONDITIONS = ("sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "clear", "stormy",
              "overcast", "partly cloudy", "light rain", "humid")
SYSTEM_LINES = (
    "You are a helpful assistant.", "You are a helpful assistant. Be concise.",
    "You are a friendly assistant that can check the weather and the time.",
    "You are Ling, a small assistant running on a Rockchip board.",
    "Answer briefly.",
)


def weather_result(rng: random.Random, city: str) -> tuple[str, list[str], dict]:
    """(tool result text, the parts an answer must quote, answer fields)."""
    t, cond = rng.randint(-25, 42), rng.choice(CONDITIONS)
    form = rng.random()
    if form < 0.55:
        text = f"{t} degrees C, {cond}"
    elif form < 0.8:
        text = f'{{"temperature_c": {t}, "condition": "{cond}"}}'
    else:
        text = f"{cond}, {t}°C"
    return text, [str(t), cond], {"t": t, "cond": cond, "c": city}


def time_result(rng: random.Random, city: str) -> tuple[str, list[str], dict]:
    hhmm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    form = rng.random()
    text = hhmm if form < 0.6 else (f'{{"time": "{hhmm}"}}' if form < 0.85 else
                                     f"{hhmm} local time")
    return text, [hhmm], {"hhmm": hhmm, "c": city}


def forecast_result(rng: random.Random, city: str, day: str) -> tuple[str, list[str], dict]:
    lo = rng.randint(-20, 30)
    hi, cond = lo + rng.randint(1, 12), rng.choice(CONDITIONS)
    text = f"{day}: {cond}, high {hi} C, low {lo} C"
    return text, [cond, str(hi), str(lo)], {"cond": cond, "hi": hi, "lo": lo, "c": city,
                                            "d": day}


WEATHER_ANSWERS = (
    "It is {t} degrees C and {cond} in {c}.", "The weather in {c}: {t} degrees C, {cond}.",
    "{c} is {cond} at {t} degrees C right now.", "Right now in {c} it is {cond}, {t} degrees C.",
)
TIME_ANSWERS = (
    "The local time in {c} is {hhmm}.", "It is {hhmm} in {c} right now.",
    "In {c} it is currently {hhmm}.",
)
FORECAST_ANSWERS = (
    "The forecast for {c} ({d}): {cond}, high {hi} C, low {lo} C.",
    "{c} {d}: {cond}, with a high of {hi} C and a low of {lo} C.",
)


@dataclass
class ToolTask:
    tool: str
    arguments: dict[str, str]
    question: str
    result: str
    quote: list[str]
    answer: str
    reasoning_call: str = ""
    reasoning_answer: str = ""


def tool_task(rng: random.Random, city: str, tool: str | None = None,
              forecast_declared: bool = True) -> ToolTask:
    """A question about ``city``, its call, result and answer. Without a declared forecast
    tool a forecast question is still a weather question: the call is ``get_weather`` (the
    first demo called the undeclared ``get_forecast`` for "How warm is it in X today?")."""
    # time above weather: forecast questions without a forecast tool are weather ones too
    tool = tool or rng.choices(("get_weather", "get_time", "get_forecast"), (4, 5, 2))[0]
    if tool == "get_forecast" and not forecast_declared:
        day = rng.choice(FORECAST_DAYS)
        question = rng.choice(FORECAST_QUESTIONS[day]).format(c=city)
        result, quote, fields = weather_result(rng, city)
        return ToolTask(
            "get_weather", {"city": city}, question, result, quote,
            rng.choice(WEATHER_ANSWERS).format(**fields),
            reasoning_call=(f"The user asks about the weather in {city} {_DAY_WORDS[day]}. "
                            "There is no forecast tool, so I will call get_weather."),
            reasoning_answer=f"The tool returned {result}. I will tell the user.",
        )
    if tool == "get_forecast":
        day = rng.choice(FORECAST_DAYS)
        question = rng.choice(FORECAST_QUESTIONS[day]).format(c=city)
        result, quote, fields = forecast_result(rng, city, day)
        answer = rng.choice(FORECAST_ANSWERS).format(**fields)
        arguments = {"city": city, "day": day}
        what = f"the {day} forecast for {city}"
    else:
        question = draw_question(rng, tool).format(c=city)
        maker = weather_result if tool == "get_weather" else time_result
        result, quote, fields = maker(rng, city)
        answer = rng.choice(WEATHER_ANSWERS if tool == "get_weather" else TIME_ANSWERS
                            ).format(**fields)
        arguments = {"city": city}
        what = ("the weather in " if tool == "get_weather" else "the time in ") + city
    return ToolTask(
        tool, arguments, question, result, quote, answer,
        reasoning_call=f"The user asks for {what}. I will call {tool}.",
        reasoning_answer=f"The tool returned {result}. I will tell the user.",
    )


_DAY_WORDS = {"today": "today", "tomorrow": "tomorrow", "weekend": "this weekend"}


# --------------------------------------------------------------- answers without a tool
_GREETINGS = ("Hi", "Hello!", "Hey there", "Good morning", "Good evening!", "hello",
              "Hi, how are you?", "Hey!")
_GREETING_ANSWERS = ("Hello! How can I help you today?", "Hi! What can I do for you?",
                     "Hello! I can check the weather or the time in any city.")
_IDENTITY = ("Who are you?", "What can you do?", "What are you?", "What is your name?",
             "Can you help me?", "What tools do you have?", "Hi! What can you do?",
             "Hello, who am I talking to?", "Hey, what are you?", "Good morning! Who are you?",
             "Hello there, what's your name?")
_IDENTITY_ANSWERS = (
    "I am Ling, a small demo assistant. I can look up the weather and the local time in a "
    "city.", "I can check the current weather and the local time in any city you name.")
_THANKS = ("Thanks!", "Thank you.", "Great, thanks.", "thanks a lot", "Perfect, thank you!",
           "OK, thanks.")
_THANKS_ANSWERS = ("You're welcome!", "Glad I could help.", "Anytime!",
                   "You're welcome. Anything else?")
_JOKES = ("Tell me a joke.", "Say something funny.", "Do you know a joke?")
_JOKE_ANSWERS = (
    "Why did the cloud stay home? It was feeling a little under the weather.",
    "What does a clock do when it is hungry? It goes back four seconds.",
)
_UNSUPPORTED = (
    "Send an email to {p}.", "Book a flight to {c}.", "Order a pizza for me.",
    "Set an alarm for 7 am.", "Call {p} for me.", "Buy two tickets to {c}.",
    "Turn off the lights.", "Remind me to call {p} tomorrow.", "Find a hotel in {c}.",
    "Translate this into French: good night.",
)
_UNSUPPORTED_ANSWERS = (
    "Sorry, I can't do that. None of my tools can help with it.",
    "I can't help with that: I can only check the weather and the local time.",
    "None of the available functions can do that, so I can't help with it.",
)
_PEOPLE = ("my boss", "Anna", "my mom", "Tom", "the team", "Maria", "David")


def _small_talk(rng: random.Random, pools: CityPools) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.15:
        return rng.choice(_GREETINGS), rng.choice(_GREETING_ANSWERS)
    if kind < 0.25:
        return rng.choice(_IDENTITY), rng.choice(_IDENTITY_ANSWERS)
    if kind < 0.32:
        return rng.choice(_JOKES), rng.choice(_JOKE_ANSWERS)
    if kind < 0.47:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(("plus", "+", "times", "minus"))
        value = {"plus": a + b, "+": a + b, "times": a * b, "minus": a - b}[op]
        return (rng.choice(("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b}"))
                .format(a=a, op=op, b=b), f"{a} {op} {b} is {value}.")
    if kind < 0.64:
        country = rng.choice(sorted(pools.capitals))
        return (rng.choice(("What is the capital of {y}?", "Capital of {y}?",
                            "Which city is the capital of {y}?")).format(y=country),
                f"The capital of {country} is {pools.capitals[country]}.")
    if kind < 0.8:
        city = rng.choice(pools.famous if rng.random() < 0.5 else pools.train)
        home = pools.countries.get(city)
        if home:
            return (rng.choice(("Which country is {c} in?", "Where is {c}?",
                                "In which country is {c}?")).format(c=city),
                    f"{city} is in {home}.")
    text = rng.choice(_UNSUPPORTED).format(p=rng.choice(_PEOPLE), c=rng.choice(pools.famous))
    return text, rng.choice(_UNSUPPORTED_ANSWERS)


def _assistant(content: str, reasoning: str, thinking: bool, calls: list | None = None
               ) -> Message:
    msg: Message = {"role": "assistant", "content": content}
    if thinking:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


# ------------------------------------------------------------------------ generators
class CorpusSampler:
    """Draws conversations; ``rng`` is passed per call so a batch depends only on its seed."""

    def __init__(self, pools: CityPools) -> None:
        self.pools = pools
        self.made_up = MadeUpNames(pools.train, avoid=pools.reserved)

    def city(self, rng: random.Random) -> str:
        # The best-known cities at a high share: they are what a newcomer asks first.
        r = rng.random()
        if r < 0.3:
            return rng.choice(self.pools.famous)
        if r < 0.7:
            return rng.choice(self.pools.train)
        return self.made_up.name(rng)

    def examples(self) -> tuple[str, ...]:
        """The names a schema's "e.g." draws from: real cities, famous ones included."""
        return self.pools.train

    def _exchange(self, rng: random.Random, thinking: bool, task: ToolTask) -> list[Message]:
        call_id = f"call_{rng.getrandbits(40):010x}"
        call = {"id": call_id, "type": "function",
                "function": {"name": task.tool, "arguments": dict(task.arguments)}}
        return [
            {"role": "user", "content": task.question},
            _assistant("", task.reasoning_call, thinking, [call]),
            {"role": "tool", "tool_call_id": call_id, "content": task.result},
            _assistant(task.answer, task.reasoning_answer, thinking),
        ]

    def _plain(self, rng: random.Random, thinking: bool) -> list[Message]:
        question, answer = _small_talk(rng, self.pools)
        reasoning = "No tool is needed for this. I will answer directly."
        return [{"role": "user", "content": question}, _assistant(answer, reasoning, thinking)]

    def full(self, rng: random.Random) -> Conversation:
        """A chat with the whole tools prompt: 1-3 exchanges, mostly tool loops."""
        thinking = rng.random() < 0.5  # the server's default is thinking on
        messages: list[Message] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_LINES)})
        needed: list[str] = []
        forecast_declared = rng.random() < 0.6
        for _ in range(rng.choices((1, 2, 3), (60, 30, 10))[0]):
            if rng.random() < 0.78:
                task = tool_task(rng, self.city(rng), forecast_declared=forecast_declared)
                needed.append(task.tool)
                messages += self._exchange(rng, thinking, task)
            else:
                messages += self._plain(rng, thinking)
        withheld = frozenset() if forecast_declared else frozenset({"get_forecast"})
        tools = tool_list(sorted(set(needed)) or [rng.choice(("get_weather", "get_time"))],
                          rng, self.examples(), withheld)
        return Conversation(messages, tools, thinking)

    def short(self, rng: random.Random) -> Conversation:
        """Short items without the long tools prompt: echo copies and one-tool chats."""
        if rng.random() < 0.4:
            return self.echo(rng)
        thinking = rng.random() < 0.4
        task = tool_task(rng, self.city(rng))
        names = [task.tool]
        if task.tool != "get_forecast" and rng.random() < 0.5:  # choose between the two
            names.append("get_time" if task.tool == "get_weather" else "get_weather")
            rng.shuffle(names)
        params = list(task.arguments) if task.tool == "get_forecast" else ["city"]
        minimal = [{"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {k: {"type": "string"} for k in params}}}}
            for name in names]
        return Conversation(self._exchange(rng, thinking, task), minimal, thinking)

    def echo(self, rng: random.Random) -> Conversation:
        """``Repeat after me: X`` -> ``X``: pure copying of 1-3 names (the warm-up task),
        mostly made up, so that copying is the only way to the answer."""
        count = rng.choices((1, 2, 3), (60, 25, 15))[0]
        names = [self.made_up.name(rng) if rng.random() < 0.7 else self.city(rng)
                 for _ in range(count)]
        text = ", ".join(names)
        prompt = rng.choice(("Repeat after me: {x}", "Say {x}", "Please repeat: {x}",
                             "Echo this: {x}", "Copy exactly: {x}"))
        return Conversation([{"role": "user", "content": prompt.format(x=text)},
                             {"role": "assistant", "content": text}], None, False)

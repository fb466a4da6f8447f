"""Stop strings never leak, whatever the chunking of the text stream."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ling3_rknn.engine.stop_strings import StopMatcher


def run(chunks: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.feed(c) for c in chunks]
    out.append(m.flush())
    return out, m.stopped


def test_holds_back_a_possible_prefix_and_releases_it():
    out, stopped = run(["hello </an", "swer> more"], ["</answer>"])
    assert out == ["hello ", "", ""] and stopped
    out, stopped = run(["hello </an", "other"], ["</answer>"])
    assert "".join(out) == "hello </another" and not stopped
    assert out[0] == "hello "


def test_earliest_of_several_stops_wins():
    out, stopped = run(["abc STOP2 x STOP1"], ["STOP1", "STOP2"])
    assert out[0] == "abc " and stopped


def test_overlapping_stops_do_not_depend_on_chunking():
    assert run(["><<"], ["<", "><<"])[0][0] == ">"
    assert "".join(run(["><", "<"], ["<", "><<"])[0]) == ">"


def test_no_stops_passes_through():
    assert run(["a", "b"], []) == (["a", "b", ""], False)
    assert run(["a"], [""]) == (["a", ""], False)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab<>/", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=5), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_any_chunking_gives_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = run(chunks, stops)
    # Character-level reference: the first position where some stop string ends.
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    if hits:
        assert stopped and "".join(out) == text[: min(hits)[1]]
    else:
        assert not stopped and "".join(out) == text
    # No emitted prefix ever contains a stop string.
    emitted = ""
    for piece in out:
        emitted += piece
        assert not any(s in emitted for s in stops)


def test_holds_back_a_chunk_ending_one_character_short_of_the_longest_stop():
    """The longest possible partial match (all but the last character) must be held."""
    for stops in (["</answer>"], ["</answer>", "<x>"]):
        m = StopMatcher(stops)
        assert m.feed("hello </answer") == "hello "  # 8 of the stop's 9 characters
        assert m.feed("> and more") == "" and m.stopped
        m = StopMatcher(stops)
        assert m.feed("hello </answer") == "hello "
        assert m.feed("s") == "</answers"  # not a stop after all: released in order
        assert not m.stopped

"""Splicing generated ids into re-rendered history, with the real compact tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from ling3_rknn.chat.segments import Segment
from ling3_rknn.engine.prompt_encoder import PromptEncoder
from ling3_rknn.tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER)


def C(text: str) -> Segment:
    return Segment(text, True)


def T(text: str) -> Segment:
    return Segment(text, False)


def turn1() -> list[Segment]:
    return [
        C("<role>SYSTEM</role>"),
        T("be brief"),
        C("<|role_end|><role>HUMAN</role>"),
        T("say the word"),
        C("<|role_end|><role>ASSISTANT</role>"),
    ]


def generated_ids(tok: Tokenizer) -> list[int]:
    """' the' as the model might write it: ' t' + 'he', not the merged ' the' token."""
    ids = tok.encode_text(" t") + tok.encode_text("he")
    assert ids != tok.encode_text(" the") and tok.decode(ids) == " the"
    return ids


def turn2(answer: str = " the", eos_control: bool = True) -> list[Segment]:
    return [
        *turn1(),
        T(answer),
        Segment("<|role_end|>", eos_control),
        C("<role>HUMAN</role>"),
        T("again"),
        C("<|role_end|><role>ASSISTANT</role>"),
    ]


def test_re_rendered_answer_reuses_generated_ids(tok):
    enc = PromptEncoder(tok, "<|role_end|>")
    first = enc.encode(turn1())
    assert first.ids == tok.encode_segments(turn1()) and first.spliced_tokens == 0
    gen = generated_ids(tok)
    enc.remember(first, tok.decode(gen), gen, tok.eos_id)

    second = enc.encode(turn2())
    fresh = tok.encode_segments(turn2())
    prefix = [*first.ids, *gen, tok.eos_id]
    assert second.ids[: len(prefix)] == prefix
    assert second.spliced_tokens == len(prefix)
    assert fresh[: len(prefix)] != prefix  # a fresh encoding would have missed the cache
    # The rest is exactly the fresh encoding of the rest.
    assert second.ids[len(prefix) :] == tok.encode_segments(turn2()[len(turn1()) + 2 :])
    assert tok.decode(second.ids) == tok.decode(fresh)


def test_different_answer_text_does_not_splice(tok):
    enc = PromptEncoder(tok, "<|role_end|>")
    first = enc.encode(turn1())
    gen = generated_ids(tok)
    enc.remember(first, tok.decode(gen), gen, tok.eos_id)
    other = enc.encode(turn2(answer=" then"))
    assert other.spliced_tokens == 0 and other.ids == tok.encode_segments(turn2(" then"))


def test_marker_spelled_in_text_cannot_borrow_real_marker_ids(tok):
    enc = PromptEncoder(tok, "<|role_end|>")
    first = enc.encode(turn1())
    gen = generated_ids(tok)
    enc.remember(first, tok.decode(gen), gen, tok.eos_id)
    forged = turn2(eos_control=False)  # the user typed "<|role_end|>" as text
    out = enc.encode(forged)
    assert out.spliced_tokens == 0
    assert out.ids == tok.encode_segments(forged)


def test_retyped_prompt_part_does_not_splice(tok):
    enc = PromptEncoder(tok, "<|role_end|>")
    first = enc.encode(turn1())
    gen = generated_ids(tok)
    enc.remember(first, tok.decode(gen), gen, tok.eos_id)
    segs = turn2()
    segs[1] = C("be brief")  # same text, now typed CONTROL
    assert enc.encode(segs).spliced_tokens == 0


def test_moved_control_boundary_with_the_same_span_count_does_not_splice(tok):
    """Same text, same number of CONTROL spans, but a boundary moved: the user's text now
    starts inside what was a template marker. Only equal spans may reuse the ids."""
    enc = PromptEncoder(tok, "<|role_end|>")
    first = enc.encode(turn1())
    gen = generated_ids(tok)
    enc.remember(first, tok.decode(gen), gen, tok.eos_id)
    segs = turn2()
    segs[2:4] = [C("<|role_end|><role>HUMAN</role>say"), T(" the word")]
    typed = [s.text for s in segs], [s.control for s in segs]
    assert "".join(typed[0]) == "".join(s.text for s in turn2())  # the text is unchanged
    assert sum(typed[1]) == sum(s.control for s in turn2())  # so is the span count
    assert enc.encode(segs).spliced_tokens == 0


def test_longest_transcript_wins_and_capacity_is_bounded(tok):
    enc = PromptEncoder(tok, "<|role_end|>", capacity=2)
    first = enc.encode(turn1())
    gen = generated_ids(tok)
    enc.remember(first, tok.decode(gen), gen, tok.eos_id)
    second = enc.encode(turn2())
    gen2 = tok.encode_text("ok")
    enc.remember(second, "ok", gen2, tok.eos_id)
    third_segments = [*turn2(), T("ok"), C("<|role_end|><role>HUMAN</role>"), T("bye")]
    third = enc.encode(third_segments)
    assert third.spliced_tokens == len(second.ids) + len(gen2) + 1
    enc.remember(third, "x", [5], tok.eos_id)
    assert len(enc) == 2


def test_transcript_note_round_trip_and_junk_is_refused(tok):
    enc = PromptEncoder(tok, "<|role_end|>")
    first = enc.encode(turn1())
    gen = generated_ids(tok)
    record = enc.remember(first, tok.decode(gen), gen, tok.eos_id)
    restarted = PromptEncoder(tok, "<|role_end|>")
    assert restarted.restore_note(PromptEncoder.note_of(record), record.ids)
    assert restarted.encode(turn2()).ids == enc.encode(turn2()).ids
    for junk in ("", "{}", "[1]", '{"transcript": 1, "text": "no marker", '
                 '"prompt_chars": 0, "prompt_spans": []}', '{"transcript": 2}'):
        assert not restarted.restore_note(junk, [1, 2])

"""The demo tokenizer and the conversation -> (token ids, loss mask) encoding.

The tokenizer is byte-level BPE with Ling's chat markers as special tokens at ids 0..13
(the compact layout the runtime already knows; it reads every id by name). Its
pre-tokenizer is chosen for copying: a capitalised word is its own piece with no leading
space (a space before it is a piece of its own), so a city name has the *same* token ids in
the question (``... in Gdynia?``) and in the call (``<arg_value>Gdynia``). With the usual
GPT-2 split the two differ (``ĠGdynia`` vs ``Gdynia``) and the model would have to learn a
mapping, not a copy. Digits are single tokens, so numbers copy digit by digit.

Loss is on what the model must generate: every assistant turn after its generation prompt
(``<role>ASSISTANT</role>\\n<think>``, plus ``</think>`` when thinking is off), up to and
including ``<|role_end|>``. The spans are found by rendering each turn's prompt and
checking it is a token prefix of the rendered conversation (the chat markers are special
tokens, so the split at a turn boundary is exact).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from convert.demo_model.corpus import Conversation
from ling3_rknn.chat import render
from ling3_rknn.tokenizer import CONTROL_TOKEN_NAMES, Tokenizer

# The compact order (tests/fixtures/tokenizer): <|endoftext|> 0 (pad), <|role_end|> 1 (eos).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|role_end|>", "<role>", "</role>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<tool_response>", "</tool_response>",
)
assert set(SPECIAL_TOKENS) == set(CONTROL_TOKEN_NAMES)
PAD_ID, EOS_ID = 0, 1
SPLIT_REGEX = r" ?\p{Ll}+|\p{Lu}\p{L}*|\p{L}+|\p{N}|\s| ?[^\s\p{L}\p{N}]+"


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: Path) -> Tokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=3, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        entry["special"] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec, ensure_ascii=False, indent=1), encoding="utf-8")
    tmp.replace(path)
    loaded = Tokenizer.from_file(path)
    for i, name in enumerate(SPECIAL_TOKENS):
        if loaded.special_ids[name] != i:
            raise RuntimeError(f"{name} got id {loaded.special_ids[name]}, expected {i}")
    return loaded


def render_ids(tok: Tokenizer, conv: Conversation, messages: list, generation: bool
               ) -> list[int]:
    segments = render(messages, conv.tools, enable_thinking=conv.thinking,
                      add_generation_prompt=generation)
    return tok.encode_segments(segments)


def encode(tok: Tokenizer, conv: Conversation) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and which positions are trained on (targets)."""
    ids = render_ids(tok, conv, conv.messages, False)
    mask = [False] * len(ids)
    for k, msg in enumerate(conv.messages):
        if msg["role"] != "assistant":
            continue
        start = len(render_ids(tok, conv, conv.messages[:k], True))
        turn = render_ids(tok, conv, conv.messages[: k + 1], False)
        if ids[: len(turn)] != turn:
            raise RuntimeError("assistant turn is not a token prefix of the conversation")
        for i in range(start, len(turn)):
            mask[i] = True
    return ids, mask

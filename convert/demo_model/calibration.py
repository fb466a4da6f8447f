"""Calibration prompts for converting the demo model: its own conversations, as token ids.

    .venv-oracle/bin/python -m convert.demo_model.calibration CHECKPOINT/tokenizer.json OUT.jsonl

The converter's built-in prompts are generic English; the demo model's activations (and its
expert routing, which decides placement) are those of tool chats. Ids rather than text so
the chat markers are the special tokens they are in serving (a text prompt is encoded as
plain text). Drawn from a seed of their own, so they are not the training batches.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from convert.demo_model.corpus import CorpusSampler
from convert.demo_model.encode import encode
from convert.demo_model.names import city_pools
from ling3_rknn.tokenizer import Tokenizer

SEED = 777
COUNT = 24


def write_calibration(tokenizer: Path, out: Path, count: int = COUNT) -> None:
    tok = Tokenizer.from_file(tokenizer)
    sampler = CorpusSampler(city_pools())
    rng = random.Random(SEED)
    lines = []
    for i in range(count):
        conv = sampler.full(rng) if i % 3 else sampler.short(rng)
        ids, _ = encode(tok, conv)
        lines.append(json.dumps({"ids": ids}))
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    write_calibration(Path(sys.argv[1]), Path(sys.argv[2]))

"""A tiny random Ling-3.0 checkpoint whose vocabulary fits the compact test tokenizer.

Built with numpy + safetensors from the committed oracle fixture (same config and
tensors, embedding and lm_head redrawn at vocab 1024, eos = the compact tokenizer's
``<|role_end|>`` id 1). The model's math is pinned by the oracle tests; this checkpoint
only exists so the engine can be tested end to end with real state snapshots.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ORACLE = Path(__file__).parent / "fixtures" / "oracle" / "plainq_released"
VOCAB = 1024


def make_tiny_checkpoint(dst: Path, *, vocab: int = VOCAB, seed: int = 0) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((ORACLE / "config.json").read_text())
    config.update(vocab_size=vocab, eos_token_id=1, pad_token_id=0)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(ORACLE / "model.safetensors"))
    rng = np.random.default_rng(seed)
    hidden = tensors["model.word_embeddings.weight"].shape[1]
    tensors["model.word_embeddings.weight"] = rng.standard_normal((vocab, hidden)).astype(
        np.float32
    )
    tensors["lm_head.weight"] = (rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(
        np.float32
    )
    save_file(tensors, str(dst / "model.safetensors"))
    return dst

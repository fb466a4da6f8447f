"""An HF checkpoint directory: config.json plus one or many (indexed) safetensors files.

Tensor names are normalised to the released checkpoint's spelling so that the files written
by transformers (``save_pretrained``, or a raw ``state_dict`` with its module names) load too:
``model.embed_tokens`` -> ``model.word_embeddings``, ``self_attn`` -> ``attention``,
``attention.forget_gate.*`` -> ``attention.*``, ``gate.e_score_correction_bias`` ->
``gate.expert_bias``. Layer-dependent spellings (KDA ``o_proj``/``dense``, merged conv and
merged experts) are resolved by ``weights.py``, which knows the layer types.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from .safetensors_file import CheckpointError, SafetensorsFile

_RENAMES = (
    (re.compile(r"^model\.embed_tokens\."), "model.word_embeddings."),
    (re.compile(r"\.self_attn\."), ".attention."),
    (re.compile(r"\.attention\.forget_gate\."), ".attention."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"),
)


def canonical_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


class Checkpoint:
    """Name -> lazily read float32 tensor, with shape checks that name the tensor."""

    def __init__(self, files: list[SafetensorsFile]) -> None:
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in files:
            for stored in f.names():
                name = canonical_name(stored)
                if name in self._where:
                    other = self._where[name][1]
                    raise CheckpointError(
                        f"tensor {name!r} is stored twice ({other!r} and {stored!r} in {f.path})"
                    )
                self._where[name] = (f, stored)

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Checkpoint:
        root = Path(directory)
        index = root / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: unreadable index: {e}") from None
            paths = [root / n for n in names]
            for p in paths:
                if not p.is_file():
                    raise CheckpointError(f"{index}: lists {p.name}, which does not exist")
        else:
            paths = sorted(root.glob("*.safetensors"))
            if not paths:
                raise CheckpointError(f"{root}: no *.safetensors file")
        return cls([SafetensorsFile(p) for p in paths])

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        f, stored = self._where[name]
        return f.shape(stored)

    def locate(self, name: str, shape: tuple[int, ...]) -> tuple[SafetensorsFile, str]:
        if name not in self._where:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {list(shape)})")
        f, stored = self._where[name]
        if f.shape(stored) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(f.shape(stored))}, expected {list(shape)}"
            )
        return f, stored

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as float32 with exactly ``shape``; read-only when memory-mapped."""
        f, stored = self.locate(name, shape)
        return f.float32(stored)

    def rows(self, name: str, shape: tuple[int, ...], ids: np.ndarray | int) -> np.ndarray:
        """Selected first-axis entries as float32, without widening the whole tensor."""
        f, stored = self.locate(name, shape)
        return f.float32_rows(stored, ids)

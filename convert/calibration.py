"""Calibration: run the float32 numpy model on real prompts and record what the NPU sees.

Two products: (1) the real inputs of every stage graph (hidden states, recurrence
outputs, attention contexts), cut into ``[1, chunk, width]`` samples, as rknn-toolkit2's
w8a8 quantization dataset (random data would give the wrong activation ranges); (2) how
often each routed expert is selected, for the placement plan.

Prompts come from ``--calibration FILE`` (JSONL: a string, ``{"text": ...}`` or
``{"ids": [...]}`` per line; any other file: plain text, prompts separated by blank lines)
or the built-in set below, tokenized with the bundle's tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ling3_rknn.bundle import StageName
from ling3_rknn.config import ModelConfig
from ling3_rknn.model import CpuWeights, Model, NumpyStages
from ling3_rknn.model.moe import NumpyExperts
from ling3_rknn.model.stages import KdaInputs, LayerOutput, MlaInputs, kda_core_norm
from ling3_rknn.model.weights import CheckpointWeights

# Varied on purpose: chat, code, tool calls, reasoning, other languages, numbers. Real
# agent traffic is the target, so a system prompt and a tool schema are in here too.
DEFAULT_PROMPTS = (
    "<role>SYSTEM</role>You are a helpful coding agent. You can call tools to read and edit "
    "files. Answer concisely.<|role_end|><role>HUMAN</role>Why does my Python script raise "
    "KeyError: 'name' when the JSON file has that key?<|role_end|><role>ASSISTANT</role>",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    seq = [0, 1]\n    while len(seq) < n:\n        seq.append(seq[-1] + seq[-2])\n"
    "    return seq[:n]\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
    '<tool_call>{"name": "read_file", "arguments": {"path": "src/main.rs"}}</tool_call>\n'
    "fn main() {\n    let args: Vec<String> = std::env::args().collect();\n"
    '    println!("{:?}", args);\n}\n',
    "The RK3588 has a 6 TOPS NPU with three cores. Large language models are memory bound: "
    "each decoded token reads every active weight once, so bandwidth decides the speed.",
    "Question: A train leaves at 14:35 and arrives at 17:10. How long is the journey? "
    "Let me think step by step. From 14:35 to 17:35 is 3 hours; 25 minutes less gives "
    "2 hours 35 minutes.",
    "Der schnelle braune Fuchs springt über den faulen Hund. 敏捷的棕色狐狸跳过了懒狗。"
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "SELECT user_id, COUNT(*) AS orders FROM orders WHERE created_at > '2024-01-01' "
    "GROUP BY user_id HAVING COUNT(*) > 5 ORDER BY orders DESC LIMIT 20;",
    "Summarise the following log:\n2026-11-29T20:35:01Z ERROR db: connection refused "
    "(retry 3/5)\n2026-11-29T20:35:04Z WARN http: 503 on /v1/chat/completions\n",
)


class CalibrationError(ValueError):
    """The calibration prompts cannot be read or do not fit the model."""


def load_prompts(path: str | os.PathLike[str] | None,
                 encode: Callable[[str], list[int]] | None) -> list[list[int]]:
    """Token ids of every calibration prompt (``encode`` may be None for ids-only files)."""
    items: list[str | list[int]]
    if path is None:
        items = list(DEFAULT_PROMPTS)
    else:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CalibrationError(f"cannot read calibration file {p.name}: {exc}") from None
        items = _parse_jsonl(text, p.name) if p.suffix == ".jsonl" else [
            block.strip() for block in text.split("\n\n") if block.strip()]
    prompts = []
    for item in items:
        if isinstance(item, str):
            if encode is None:
                raise CalibrationError("text prompts need a tokenizer")
            ids = list(encode(item))
        else:
            ids = item
        if ids:
            prompts.append(ids)
    if not prompts:
        raise CalibrationError("no calibration prompts (the file is empty)")
    return prompts


def _parse_jsonl(text: str, name: str) -> list[str | list[int]]:
    items: list[str | list[int]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{name}:{n}: not JSON: {exc}") from None
        if isinstance(obj, dict) and "text" in obj:
            obj = obj["text"]
        elif isinstance(obj, dict) and "ids" in obj:
            obj = obj["ids"]
        ok_ids = isinstance(obj, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in obj)
        if not (isinstance(obj, str) or ok_ids):
            raise CalibrationError(f'{name}:{n}: expected a string, {{"text": ...}} or '
                                   '{"ids": [...]}')
        items.append(obj)
    return items


# --------------------------------------------------------------------------- recording
@dataclass
class CalibrationData:
    """``stage_rows[stage][input]``: recorded rows ``[R, width]``; ``route_counts[j, e]``:
    selections of expert ``e`` in MoE layer ``moe_layers[j]`` over ``tokens`` tokens."""

    chunk: int
    stage_rows: dict[str, dict[str, np.ndarray]]
    moe_layers: list[int]
    route_counts: np.ndarray
    tokens: int
    expert_rows: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def samples(self, stage: str, inputs: Sequence[str], count: int) -> dict[str, np.ndarray]:
        """``[count, 1, chunk, width]`` per input: consecutive recorded rows, the largest
        shape of the graph (what rknn-toolkit2 wants for a multi-shape build)."""
        rows = self.stage_rows[stage]
        return {name: _cut(rows[name], self.chunk, count) for name in inputs}

    def expert_samples(self, layer: int, expert: int, count: int) -> dict[str, np.ndarray]:
        """Inputs of one routed expert: the MoE inputs of tokens routed to it (all MoE
        inputs of the layer when calibration never routed a token there)."""
        x, ids = self.expert_rows[layer]
        mine = x[(ids == expert).any(axis=1)]
        return {"x": _cut(mine if len(mine) else x, self.chunk, count)}


def _cut(rows: np.ndarray, chunk: int, count: int) -> np.ndarray:
    need = chunk * count
    if len(rows) < need:  # few calibration tokens: reuse them rather than invent data
        rows = np.resize(rows, (need, rows.shape[1]))
    return np.ascontiguousarray(rows[:need].reshape(count, 1, chunk, rows.shape[1]),
                                dtype=np.float32)


class _Recorder:
    """Keeps ``capacity`` of the pieces (one forward call each) a stage sees.

    Half the room goes to prompt openings (each prompt's first piece, where the KDA state
    is empty and the first token has its own activation regime), the rest to a uniform
    draw over all other pieces of all prompts (reservoir sampling, seeded). Keeping just
    the first pieces seen left every prompt after the first few unseen, and a held-out
    token outside the calibrated range is clipped by a w8a8 graph; a uniform draw alone
    can miss the openings (convert/README.md)."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity = capacity
        self.opening = True  # set by the calibration loop before each forward call
        self._rng = np.random.default_rng(seed)
        self._pools: dict[tuple[str, bool], list[dict[str, np.ndarray]]] = {}
        self._seen: dict[tuple[str, bool], int] = {}

    def add(self, stage: str, **inputs: np.ndarray) -> None:
        key = (stage, self.opening)
        room = max(1, self.capacity // 2) if self.opening else self.capacity
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + 1
        pool = self._pools.setdefault(key, [])
        slot = seen if seen < room else int(self._rng.integers(0, seen + 1))
        if slot >= room:
            return
        piece = {name: _rows(x) for name, x in inputs.items()}
        if slot == len(pool):
            pool.append(piece)
        else:
            pool[slot] = piece

    def arrays(self) -> dict[str, dict[str, np.ndarray]]:
        out = {}
        for stage in dict.fromkeys(s for s, _ in self._pools):
            pieces = self._pools.get((stage, True), [])
            rest = self._pools.get((stage, False), [])
            order = self._rng.permutation(len(rest))[: self.capacity - len(pieces)]
            pieces = pieces + [rest[i] for i in sorted(order)]
            out[stage] = {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
        return out


def _rows(x: np.ndarray) -> np.ndarray:
    """``[T, ...]`` -> a private ``[T, width]`` copy; floats as float32, ids kept as ids."""
    x = np.asarray(x)
    dtype = np.float32 if np.issubdtype(x.dtype, np.floating) else x.dtype
    return np.array(x.reshape(x.shape[0], -1), dtype=dtype)


class _RecordingStages:
    """``NumpyStages`` that also records every stage's inputs (the calibration set)."""

    def __init__(self, inner: NumpyStages, rec: _Recorder, eps: float) -> None:
        self._inner, self._rec, self._eps = inner, rec, eps

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._inner.embed(ids)

    def kda_input(self, layer: int, x: np.ndarray) -> KdaInputs:
        self._rec.add(str(StageName.layer_in(layer)), x=x)
        return self._inner.kda_input(layer, x)

    def mla_input(self, layer: int, x: np.ndarray) -> MlaInputs:
        self._rec.add(str(StageName.layer_in(layer)), x=x)
        return self._inner.mla_input(layer, x)

    def kda_output(self, layer: int, x: np.ndarray, core: np.ndarray, out_gate: np.ndarray
                   ) -> LayerOutput:
        self._rec.add(str(StageName.layer_out(layer)), x=x, out_gate=out_gate,
                      core_normed=kda_core_norm(core, self._eps))
        return self._inner.kda_output(layer, x, core, out_gate)

    def mla_output(self, layer: int, x: np.ndarray, ctx: np.ndarray, gate: np.ndarray
                   ) -> LayerOutput:
        self._rec.add(str(StageName.layer_out(layer)), x=x, ctx=ctx, gate=gate)
        return self._inner.mla_output(layer, x, ctx, gate)

    def final(self, x: np.ndarray) -> np.ndarray:
        self._rec.add(str(StageName.final()), x=x)
        return self._inner.final(x)


class _RecordingExperts:
    """Numpy experts that count routing decisions and keep MoE inputs per layer."""

    def __init__(self, inner: NumpyExperts, cfg: ModelConfig, capacity: int) -> None:
        self._inner = inner
        self.moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.counts = np.zeros((len(self.moe_layers), cfg.num_experts), np.int64)
        self.recorder = _Recorder(capacity, seed=1)

    def __call__(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray
                 ) -> np.ndarray:
        np.add.at(self.counts[self.moe_layers.index(layer)], ids.reshape(-1), 1)
        self.recorder.add(str(layer), x=x, ids=ids)
        return self._inner(layer, x, ids, weights)

    def rows(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        return {int(k): (v["x"], v["ids"]) for k, v in self.recorder.arrays().items()}


def calibrate(weights: CheckpointWeights, prompts: list[list[int]], chunk: int,
              samples: int, progress: Callable[[int], None] | None = None) -> CalibrationData:
    """Run every prompt through the float32 model (prefill in ``chunk`` pieces, the way the
    runtime feeds the graphs) and return what was recorded."""
    cfg = weights.cfg
    for n, ids in enumerate(prompts):
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise CalibrationError(
                f"calibration prompt {n} has token id {bad[0]} outside the model's vocabulary "
                f"[0, {cfg.vocab_size}): tokenizer and checkpoint do not belong together")
    rec = _Recorder(samples)
    experts = _RecordingExperts(NumpyExperts(weights.expert), cfg, samples)
    model = Model(cfg, _RecordingStages(NumpyStages(weights), rec, cfg.rms_norm_eps), experts,
                  CpuWeights.from_checkpoint(weights))
    tokens = 0
    for ids in prompts:
        state = model.new_state()
        ids = ids[: cfg.max_position_embeddings]
        for start in range(0, len(ids), chunk):
            rec.opening = experts.recorder.opening = start == 0
            model.forward(ids[start:start + chunk], state)
        tokens += len(ids)
        if progress is not None:
            progress(1)
    return CalibrationData(chunk, rec.arrays(), experts.moe_layers, experts.counts, tokens,
                           experts.rows())

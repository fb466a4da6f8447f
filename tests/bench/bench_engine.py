"""Engine figures: per-token overhead, snapshot/restore at real size, persisted-prefix reload.

Run: .venv/bin/python tests/bench/bench_engine.py

1. Engine overhead per decoded token, model compute excluded: a model double whose forward
   returns a preallocated logits row at Ling's vocabulary (157,184), the tokenizer with
   Ling's real special ids, the whole async path (worker thread, sampler, detokenizer,
   stop matcher, event hand-off to the asyncio consumer). Target <= 1 ms.
2. Snapshot and restore of the real model's ``SequenceState`` at Ling-3.0-tiny's real
   dimensions (18 KDA layers, 6 MLA layers) with 8K tokens in the latent cache (no weights
   are needed to build the state). Target <= 10 ms each.
3. A persisted 12K-token prefix: write time, then reload (read + checksum + from_arrays)
   vs re-prefilling 12K tokens. Re-prefill is estimated two ways: the seed C++ engine's
   board figure (185 tok/s at 466 tokens, seed-ling3-rknn-tool-calling.txt) and this
   host's measured per-token prefill cost of the tiny numpy model (a lower bound only).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from engine_doubles import ScriptedModel  # noqa: E402
from engine_tiny_model import make_tiny_checkpoint  # noqa: E402

from ling3_rknn.chat.segments import Segment  # noqa: E402
from ling3_rknn.config import ModelConfig  # noqa: E402
from ling3_rknn.engine import Engine, EngineOptions, GenerationRequest, SamplingParams  # noqa: E402
from ling3_rknn.engine.cache.snapshot_store import SnapshotStore  # noqa: E402
from ling3_rknn.model import Model, SequenceState, StateSnapshot  # noqa: E402
from ling3_rknn.model.snapshot_arrays import RowBlocks  # noqa: E402
from ling3_rknn.tokenizer import Tokenizer  # noqa: E402

VOCAB = 157_184
LING_IDS = ROOT / "tests" / "fixtures" / "tokenizer" / "ling-ids" / "tokenizer.json"
ORACLE_CONFIG = ROOT / "tests" / "fixtures" / "oracle" / "plainq_released" / "config.json"

REAL = {  # Ling-3.0-tiny, docs/model.md 1
    "vocab_size": VOCAB,
    "hidden_size": 1536,
    "num_hidden_layers": 24,
    "layer_group_size": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rotary_dim": 64,
    "intermediate_size": 4608,
    "first_k_dense_replace": 1,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "moe_shared_expert_intermediate_size": 512,
    "n_group": 8,
    "topk_group": 4,
    "max_position_embeddings": 131072,
    "eos_token_id": 156895,
    "pad_token_id": 156892,
}


def real_config() -> ModelConfig:
    d = json.loads(ORACLE_CONFIG.read_text())
    d.update(REAL)
    return ModelConfig.from_dict(d)


class ZeroCostModel(ScriptedModel):
    """Forward returns the same preallocated row: the engine's own cost is all that's left."""

    def __init__(self, row: np.ndarray) -> None:
        super().__init__(VOCAB, lambda history: 0, eos_token_ids=(156895,))
        self._row = row[None, :]

    def forward(self, token_ids, state, *, last_only: bool = False):
        return self._row


async def decode_overhead(sampling: SamplingParams, tokens: int) -> float:
    tok = Tokenizer.from_file(LING_IDS)
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
    decodable = np.zeros(VOCAB, bool)
    for i in range(tok.vocab_size):
        try:
            tok.token_bytes(i)
            decodable[i] = True
        except Exception:
            pass
    decodable[list(tok.special_ids.values())] = False
    row[~decodable] = -1e4
    engine = Engine(ZeroCostModel(row), tok,
                    EngineOptions(model_id="bench", max_context=tokens + 64, cache_bytes=0))
    prompt = [Segment("<role>HUMAN</role>", True), Segment("hello", False),
              Segment("<|role_end|><role>ASSISTANT</role>", True)]
    request = GenerationRequest(prompt, sampling, max_tokens=tokens, stop=["</stop>"])
    with engine:
        async for _ in engine.generate(GenerationRequest(prompt, sampling, max_tokens=8)):
            pass
        t0 = time.perf_counter()
        n = 0
        async for event in engine.generate(request):
            n += len(getattr(event, "token_ids", ()))
        elapsed = time.perf_counter() - t0
    return elapsed / tokens * 1e3


def filled_state(config: ModelConfig, tokens: int) -> SequenceState:
    """A state at ``tokens`` positions with random contents, through the public API only
    (the shapes come from an empty state's exported arrays)."""
    rng = np.random.default_rng(0)
    state = SequenceState(config)
    arrays = {}
    for name, value in state.snapshot().blocked_arrays().items():
        if name == "length":
            arrays[name] = np.array(tokens, dtype=np.int64)
        elif isinstance(value, RowBlocks):  # per-token: the latent caches
            width = value.partial.shape[1]
            arrays[name] = rng.standard_normal((tokens, width)).astype(np.float32)
        else:
            arrays[name] = rng.standard_normal(value.shape).astype(value.dtype)
    state.restore(StateSnapshot.from_arrays(config, arrays))
    return state


def timed(fn, repeat: int = 15) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def snapshot_figures(config: ModelConfig) -> None:
    state = filled_state(config, 8192)
    snap = state.snapshot()
    kda = sum(a.nbytes for k, a in snap.to_arrays().items() if k.startswith("kda."))
    print(f"state at 8K tokens: KDA+conv {kda / 2**20:.1f} MiB, snapshot.nbytes "
          f"{snap.nbytes / 2**20:.1f} MiB (latent shared), private "
          f"{snap.private_nbytes / 2**20:.1f} MiB")
    print(f"  snapshot(): {timed(state.snapshot):.2f} ms   restore(): "
          f"{timed(lambda: state.restore(snap)):.2f} ms   (median of 15)")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def persistence_figures(config: ModelConfig, tokens: int = 12_288) -> None:
    state = filled_state(config, tokens)
    snap = state.snapshot()
    logits = np.zeros(VOCAB, np.float32)
    path_tokens = tuple(range(tokens))
    with tempfile.TemporaryDirectory() as tmp:
        store = SnapshotStore(tmp, "bench")
        t0 = time.perf_counter()
        arrays = snap.blocked_arrays()
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.write(path_tokens, logits, arrays)
        t_write = time.perf_counter() - t0
        first_bytes = _dir_bytes(Path(tmp))
        # The next turn's snapshot: the same state 37 tokens on (the same frozen blocks).
        for cache in state.latents.values():
            cache.append(np.ones((37, cache.width), cache.dtype))
        state.length += 37
        longer = state.snapshot().blocked_arrays()
        t0 = time.perf_counter()
        store.write((*path_tokens, *range(37)), logits, longer)
        t_write2 = time.perf_counter() - t0
        second_bytes = _dir_bytes(Path(tmp)) - first_bytes
        t0 = time.perf_counter()
        index = min(store.scan(), key=lambda e: len(e.tokens))
        t_scan = time.perf_counter() - t0
        reloads = []
        for _ in range(3):
            t0 = time.perf_counter()
            loaded = SnapshotStore(tmp, "bench").load(index)  # a new process: reads disk
            restored = StateSnapshot.from_arrays(config, loaded.state)
            state.restore(restored)
            reloads.append(time.perf_counter() - t0)
    reload_s = statistics.median(reloads)
    print(f"persisted {tokens}-token prefix: {first_bytes / 2**20:.0f} MiB on disk; export "
          f"{t_export * 1e3:.0f} ms, atomic write+fsync {t_write * 1e3:.0f} ms; start-up "
          f"index of both files {t_scan * 1e3:.1f} ms")
    print(f"  next turn (+37 tokens, latent blocks shared): {second_bytes / 2**20:.1f} MiB "
          f"new on disk, write {t_write2 * 1e3:.0f} ms")
    print(f"  reload (read + sha256 + from_arrays + restore): {reload_s * 1e3:.0f} ms "
          "(median of 3, page cache warm)")
    board = tokens / 185.0
    print(f"  re-prefill on the board at the seed engine's 185 tok/s: {board:.0f} s "
          f"-> reload is {board / reload_s:.0f}x faster")


def tiny_prefill_cost() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        model = Model.from_hf(make_tiny_checkpoint(Path(tmp)))
        ids = list(range(2, 514))
        model.forward(ids[:64], model.new_state())
        t0 = time.perf_counter()
        state = model.new_state()
        for start in range(0, len(ids), 64):
            model.forward(ids[start : start + 64], state, last_only=True)
        return (time.perf_counter() - t0) / len(ids)


async def agent_turns() -> str:
    """Two turns of an agent loop on the tiny model: what turn 2 reuses and evaluates."""
    from ling3_rknn.chat import assistant_message, parse_assistant, render

    tools = [{"type": "function", "function": {
        "name": "read", "description": "Read a file from the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}}]
    history: list[dict] = [
        {"role": "system", "content": "You are a careful coding agent. Use the tools."},
        {"role": "user", "content": "Open a.py and tell me what it prints."},
    ]
    tok = Tokenizer.from_file(ROOT / "tests" / "fixtures" / "tokenizer" / "compact"
                              / "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        model = Model.from_hf(make_tiny_checkpoint(Path(tmp)))
        with Engine(model, tok, EngineOptions(model_id="tiny", max_context=4096)) as engine:
            request = GenerationRequest(render(history, tools, enable_thinking=False),
                                        SamplingParams(temperature=0.0), max_tokens=24)
            text = ""
            async for event in engine.generate(request):
                text = getattr(event, "text", text)
            history.append(assistant_message(parse_assistant(text, tools, thinking=False)))
            history.append({"role": "tool", "tool_call_id": "c1", "content": "print(42)\n"})
            await engine.idle()
            request = GenerationRequest(render(history, tools, enable_thinking=False),
                                        SamplingParams(temperature=0.0), max_tokens=8)
            usage = None
            async for event in engine.generate(request):
                usage = getattr(event, "usage", usage)
    assert usage is not None
    return (f"agent loop turn 2 (tiny model, compact tokenizer): {usage.prompt_tokens} "
            f"prompt tokens, {usage.cached_tokens} cached, "
            f"{usage.prompt_tokens - usage.cached_tokens} evaluated")


def main() -> None:
    print(asyncio.run(agent_turns()))
    for name, sampling in (
        ("greedy", SamplingParams(temperature=0.0)),
        ("ling3 defaults (T=1, top_k=20, top_p=0.95)", SamplingParams()),
    ):
        ms = asyncio.run(decode_overhead(sampling, 2000))
        print(f"engine overhead per decoded token, {name}: {ms:.3f} ms (2000 tokens)")
    config = real_config()
    snapshot_figures(config)
    persistence_figures(config)
    per_token = tiny_prefill_cost()
    print(f"tiny numpy model prefill on this host: {per_token * 1e3:.2f} ms/token "
          f"(12K tokens: {per_token * 12_288:.0f} s; a lower bound, the real model is "
          "~10^4x larger)")


if __name__ == "__main__":
    main()

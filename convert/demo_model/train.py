"""Train the embedded demo model: a 7.1M-parameter Ling-3.0 that acts as a tiny agent.

    make demo-model            # = .venv-oracle/bin/python -m convert.demo_model.train OUT

Host-only (torch 2.13.0 CPU + transformers 5.24.0 ``BailingHybridForCausalLM``); the
runtime never imports it. Deterministic: the tokenizer, the initial weights and every
batch are functions of ``--seed`` (a batch of step s is drawn from ``Random(seed, phase,
s)``), so ``--resume`` after an interruption continues the same run. About 150 minutes on
2 cores (the shipped run: 9,289 s). The recipe (measured in the project's feasibility
study, then tuned):

1. **Echo warm-up** (phase 1): ``Repeat after me: X`` -> ``X`` on short sequences, batch
   32, until teacher-forced accuracy on the first and the later tokens of never-seen
   names reach ``--copy-target`` (checked every 100 steps) or ``--copy-steps`` run out.
   This is where the copy circuit forms; without it the model learns one "average" city name.
2. **Agent chats** (phase 2): two steps in three are 4 chats with the full tools prompt,
   the third 16 short items (echo + one-tool chats); the learning rate stays high for 70 %
   of the steps, then decays (city accuracy still rises late).

Also from the study: loss on assistant tokens only, the safe-gate forget gate
re-initialised into its responsive range (``A_log`` 0, ``dt_bias`` in (-5, -1);
transformers' default leaves the sigmoid saturated and the gate gets no gradient), and
the batched KDA of ``kda_fast``. Input embedding and lm_head are separate parameters, as
in the architecture (transformers never ties this model's weights).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F

from convert.demo_model.corpus import Conversation, CorpusSampler
from convert.demo_model.encode import EOS_ID, PAD_ID, encode, train_tokenizer
from convert.demo_model.kda_fast import chunk_kda
from convert.demo_model.model_config import demo_config
from convert.demo_model.names import MadeUpNames, city_pools
from ling3_rknn import chat
from ling3_rknn.chat import render_text
from ling3_rknn.tokenizer import Tokenizer

TEMPLATE_FILE = Path(chat.__file__).with_name("chat_template.jinja")
KDA_CHUNK = 8  # fastest chunk for kda_fast on this CPU (8: 0.18 s, 16: 0.41 s, 32: 0.65 s)


@dataclass(frozen=True)
class Plan:
    seed: int = 20261201
    copy_steps: int = 1400
    copy_target: float = 0.92
    chat_steps: int = 1700
    copy_batch: int = 32
    chat_batch: int = 4
    short_batch: int = 16
    copy_lr: float = 3e-3
    chat_lr: float = 2e-3
    final_lr_ratio: float = 0.1
    warmup: int = 50
    hold: float = 0.7  # fraction of phase 2 at the full learning rate
    vocab_size: int = 800
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 200


# ----------------------------------------------------------------------------- data
def _rng(plan: Plan, *key: object) -> random.Random:
    return random.Random("-".join(map(str, (plan.seed, *key))))


def build_tokenizer(plan: Plan, sampler: CorpusSampler, path: Path) -> Tokenizer:
    rng = _rng(plan, "tokenizer")
    texts = []
    for i in range(3000):
        conv = sampler.full(rng) if i % 2 else sampler.short(rng)
        texts.append(render_text(conv.messages, conv.tools, enable_thinking=conv.thinking,
                                 add_generation_prompt=False))
    texts += list(sampler.pools.train) * 2
    texts += [sampler.made_up.name(rng) for _ in range(20000)]
    return train_tokenizer(texts, plan.vocab_size, path)


def collate(tok: Tokenizer, convs: list[Conversation]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and next-token targets (-100 where not trained on)."""
    encoded = [encode(tok, c) for c in convs]
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), PAD_ID, dtype=torch.long)
    targets = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, (seq, mask) in enumerate(encoded):
        ids[row, : len(seq)] = torch.tensor(seq)
        for i in range(1, len(seq)):
            if mask[i]:
                targets[row, i - 1] = seq[i]
    return ids, targets


def batch_for(plan: Plan, sampler: CorpusSampler, phase: int, step: int
              ) -> list[Conversation]:
    rng = _rng(plan, "batch", phase, step)
    if phase == 1:
        return [sampler.echo(rng) for _ in range(plan.copy_batch)]
    if step % 3 == 2:
        return [sampler.short(rng) for _ in range(plan.short_batch)]
    return [sampler.full(rng) for _ in range(plan.chat_batch)]


class _UnseenNames(CorpusSampler):
    """A sampler whose cities are made-up names from a separate stream: never trained on."""

    def __init__(self, base: CorpusSampler) -> None:
        self.pools = base.pools
        self.made_up = MadeUpNames(base.pools.train, avoid=base.pools.reserved)

    def city(self, rng: random.Random) -> str:
        return self.made_up.name(rng)


class ValidationSets(TypedDict):
    echo: tuple[torch.Tensor, torch.Tensor]  # collate()'s ids and targets
    chat: tuple[torch.Tensor, torch.Tensor]
    arg_value: int
    arg_end: int


def validation_sets(plan: Plan, sampler: CorpusSampler, tok: Tokenizer) -> ValidationSets:
    unseen = _UnseenNames(sampler)
    rng = _rng(plan, "validation")
    echo = [unseen.echo(rng) for _ in range(64)]
    chats = [unseen.full(rng) for _ in range(12)]
    return {"echo": collate(tok, echo), "chat": collate(tok, chats),
            "arg_value": tok.special_ids["<arg_value>"],
            "arg_end": tok.special_ids["</arg_value>"]}


@torch.no_grad()
def copy_accuracy(model, ids: torch.Tensor, targets: torch.Tensor, spans: torch.Tensor
                  ) -> tuple[float, float, float]:
    """(loss, first-token accuracy, later-token accuracy) over the ``spans`` positions."""
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    hit = logits.argmax(-1) == targets
    first = spans == 1
    later = spans == 2
    return (loss.item(), hit[first].float().mean().item() if first.any() else 0.0,
            hit[later].float().mean().item() if later.any() else 0.0)


def name_spans(ids: torch.Tensor, targets: torch.Tensor, start_id: int | None, end_ids: set[int]
               ) -> torch.Tensor:
    """1 where the target is a name's first token, 2 for its later tokens, else 0.

    A name is what the model writes between ``start_id`` (``<arg_value>``; ``None``: the
    whole assistant text of an echo item) and one of ``end_ids``.
    """
    spans = torch.zeros_like(targets)
    for row in range(ids.shape[0]):
        inside, first = start_id is None, True
        for i in range(ids.shape[1]):
            t = int(targets[row, i])
            if t < 0:
                inside, first = start_id is None, True
                continue
            if start_id is not None and int(ids[row, i]) == start_id:
                inside, first = True, True
            if not inside:
                continue
            if t in end_ids:
                inside = False
                continue
            spans[row, i] = 1 if first else 2
            first = False
    return spans


# ---------------------------------------------------------------------------- model
def new_model(plan: Plan):
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    torch.manual_seed(plan.seed)
    config = BailingHybridConfig(**demo_config())
    model = BailingHybridForCausalLM(config)
    gen = torch.Generator().manual_seed(plan.seed + 1)
    for layer in model.model.layers:
        gate = getattr(layer.self_attn, "forget_gate", None)
        if gate is not None:
            with torch.no_grad():
                gate.A_log.zero_()
                gate.dt_bias.copy_(torch.rand(gate.dt_bias.shape, generator=gen) * 4 - 5)
    return model


def use_fast_kda() -> None:
    import transformers.models.bailing_hybrid.modeling_bailing_hybrid as modeling

    modeling.chunk_kimi_delta_attention = functools.partial(chunk_kda, chunk_size=KDA_CHUNK)


def learning_rate(plan: Plan, phase: int, step: int) -> float:
    if phase == 1:
        return plan.copy_lr * min(1.0, (step + 1) / plan.warmup)
    hold = int(plan.chat_steps * plan.hold)
    if step < hold:
        return plan.chat_lr
    progress = (step - hold) / max(1, plan.chat_steps - hold)
    floor = plan.final_lr_ratio
    return plan.chat_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(model, tok_path: Path, out: Path) -> None:
    """The trained model as Ling-3.0 ships: bf16 safetensors, transformers' names."""
    from transformers import GenerationConfig

    tmp = out.with_name(out.name + ".tmp")
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    model.to(torch.float32)
    # Greedy by default: the demo is a deterministic first test, not a creative writer.
    # Generation ends at <|role_end|> and at <|endoftext|> (the pad id).
    GenerationConfig(eos_token_id=[EOS_ID, PAD_ID], pad_token_id=PAD_ID,
                     do_sample=False).save_pretrained(tmp)
    (tmp / "tokenizer.json").write_bytes(tok_path.read_bytes())
    # A checkpoint carries its chat template: the official one the renderer implements.
    (tmp / "chat_template.jinja").write_bytes(TEMPLATE_FILE.read_bytes())
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.replace(out)


# ------------------------------------------------------------------------- training
def _logged_step(line: str) -> float:
    """The step a log line belongs to; a line torn by the interruption counts as later."""
    try:
        return json.loads(line).get("t", 0)
    except ValueError:
        return math.inf


class RunLog:
    def __init__(self, path: Path, keep_until: int | None) -> None:
        self.path = path
        lines = path.read_text().splitlines() if path.exists() else []
        if keep_until is not None:  # resume: drop what was logged after the saved state
            lines = [ln for ln in lines if _logged_step(ln) <= keep_until]
        else:
            lines = []
        path.write_text("".join(ln + "\n" for ln in lines))

    def write(self, **entry: object) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def train(plan: Plan, out: Path, resume: bool, threads: int) -> None:
    from tqdm import tqdm

    torch.set_num_threads(threads)
    use_fast_kda()
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    pools = city_pools()
    sampler = CorpusSampler(pools)
    tok_path = work / "tokenizer.json"
    tok = (Tokenizer.from_file(tok_path) if resume and tok_path.exists()
           else build_tokenizer(plan, sampler, tok_path))
    model = new_model(plan)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=plan.copy_lr, betas=(0.9, 0.95))
    state_path = work / "state.pt"
    phase, step, total, copy_done_at, elapsed0 = 1, 0, 0, None, 0.0
    resuming = resume and state_path.exists()
    if resuming:
        saved = torch.load(state_path, weights_only=True)
        if saved.get("seed", plan.seed) != plan.seed:
            raise SystemExit(f"{state_path} is a run with seed {saved['seed']}, not "
                             f"{plan.seed}: resume it with that seed or start elsewhere")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        phase, step, total = saved["phase"], saved["step"], saved["total"]
        copy_done_at, elapsed0 = saved["copy_done_at"], saved["elapsed"]
    if resuming and phase == 2 and step >= plan.chat_steps and (out / "checkpoint").is_dir():
        return  # this run has finished: nothing to resume
    log = RunLog(out / "train_log.jsonl", total if resuming else None)
    if resuming:
        log.write(t=total, event="resume", plan=plan.__dict__)
    else:
        log.write(t=0, event="start", plan=plan.__dict__,
                  parameters=sum(p.numel() for p in model.parameters()))
    val = validation_sets(plan, sampler, tok)
    echo_spans = name_spans(*val["echo"], None, {tok.eos_id})
    chat_spans = name_spans(*val["chat"], val["arg_value"], {val["arg_end"]})
    bar = tqdm(total=(copy_done_at or plan.copy_steps) + plan.chat_steps, initial=total,
               unit="step", desc="demo model", dynamic_ncols=True)
    start, losses, tokens = time.time() - elapsed0, [], 0

    def checkpoint() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "phase": phase,
                    "seed": plan.seed,
                    "step": step, "total": total, "copy_done_at": copy_done_at,
                    "elapsed": time.time() - start}, tmp)
        tmp.replace(state_path)

    while phase == 1 or step < plan.chat_steps:
        if phase == 1 and step >= plan.copy_steps:
            phase, step, copy_done_at = 2, 0, total
            log.write(t=total, event="copy phase ended", reason="step budget")
            continue
        model.train()
        for group in opt.param_groups:
            group["lr"] = learning_rate(plan, phase, step)
        ids, targets = collate(tok, batch_for(plan, sampler, phase, step))
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        tokens += ids.numel()
        step, total = step + 1, total + 1
        bar.update(1)
        if total % plan.log_every == 0:
            mean = sum(losses) / len(losses)
            bar.set_postfix(phase=phase, loss=f"{mean:.3f}")
            log.write(t=total, phase=phase, step=step, loss=round(mean, 4),
                      lr=opt.param_groups[0]["lr"], tokens=tokens,
                      s=round(time.time() - start, 1))
            losses, tokens = [], 0
        if step % plan.eval_every == 0:
            model.eval()
            e_loss, e_first, e_later = copy_accuracy(model, *val["echo"], echo_spans)
            c_loss, c_first, c_later = copy_accuracy(model, *val["chat"], chat_spans)
            log.write(t=total, phase=phase, step=step, eval_echo_loss=round(e_loss, 4),
                      echo_first=round(e_first, 3), echo_later=round(e_later, 3),
                      eval_chat_loss=round(c_loss, 4), arg_first=round(c_first, 3),
                      arg_later=round(c_later, 3), s=round(time.time() - start, 1))
            bar.write(f"[{total}] phase {phase} echo first/later {e_first:.2f}/{e_later:.2f}"
                      f" arg {c_first:.2f}/{c_later:.2f} chat loss {c_loss:.3f}")
            if phase == 1 and e_later >= plan.copy_target and e_first >= plan.copy_target:
                phase, step, copy_done_at = 2, 0, total
                log.write(t=total, event="copy phase ended", reason="copy target reached")
        if total % plan.save_every == 0:
            checkpoint()
    bar.close()
    save_checkpoint(model, tok_path, out / "checkpoint")
    log.write(t=total, event="done", copy_phase_steps=copy_done_at,
              s=round(time.time() - start, 1))
    checkpoint()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="output folder: checkpoint/, train_log.jsonl")
    ap.add_argument("--resume", action="store_true", help="continue from out/.work/state.pt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copy-steps", type=int, default=Plan.copy_steps)
    ap.add_argument("--chat-steps", type=int, default=Plan.chat_steps)
    ap.add_argument("--seed", type=int, default=Plan.seed)
    args = ap.parse_args(argv)
    plan = Plan(seed=args.seed, copy_steps=args.copy_steps, chat_steps=args.chat_steps)
    train(plan, args.out, args.resume, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The generation loop that owns the model: resume from the cache, prefill, decode.

Runs on the engine's single worker thread and knows nothing about asyncio: it reports
events through a callback and polls a cancel flag between model calls (so a cancelled
request stops within one decode token or one prefill chunk). Decoded text goes through
the request's parser on this thread (``parsed_turn``): the events reported are already
reasoning, content and calls, and the finished turn is remembered by the form the parser
derived from that one pass (docs/serving.md section 8).

Snapshots are taken (a) at turn boundaries inside a long prompt (after the first turn,
i.e. the system and tools header, and before the last turn), (b) at the end of every
prompt and (c) after every generation that ended with the end-of-turn marker or at the
length limit. For (c) the marker itself is fed to the model after the client has its
``Finished`` event, so the snapshot sits exactly where the next turn of an agent loop
continues and that turn evaluates only its own new tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic

import numpy as np

from ling3_rknn.chat.events import Finished, FinishReason, GenerationEvent, TextDelta, Usage

from .api import EngineFailure, InvalidRequest, TurnParser
from .cache import PrefixCache
from .call_guard import LazyCalls, MarkerBan
from .grammar_constraint import TokenConstraint
from .parsed_turn import ParsedTurn
from .prompt_encoder import EncodedPrompt, PromptEncoder, Transcript
from .protocols import ModelLike, StateT, TokenizerLike
from .sampler import Sampler, SamplerSettings
from .stop_strings import StopMatcher

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One admitted request as the worker sees it."""

    prompt: EncodedPrompt
    settings: SamplerSettings
    max_tokens: int | None  # the answer's token budget (already clamped to the room)
    stops: tuple[str, ...]
    emit: Callable[[GenerationEvent | BaseException], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    parser: Callable[[], TurnParser] | None = None
    # the grammar every token must continue, or a marker ban (``call_guard``)
    constraint: TokenConstraint | MarkerBan | LazyCalls | None = None


@dataclass
class Counters:
    """Mutable engine counters, updated by the worker under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    cache_hits: int = 0
    cache_tokens_reused: int = 0
    npu_errors: int = 0
    cancelled: int = 0


@dataclass(frozen=True)
class Decoded:
    """How one generation ended."""

    reason: str  # "eos", "length" or "stop_string"
    generated: list[int]
    unevaluated: list[int]  # generated ids (no end marker) the model has not evaluated yet
    turn: ParsedTurn
    finished: Finished


class Cancelled(Exception):
    """The consumer went away; stop quietly."""


@dataclass(frozen=True)
class RunnerOptions:
    max_context: int
    prefill_chunk: int = 64
    checkpoint_min_tokens: int = 64  # no boundary snapshot closer than this to another
    eos_token_ids: tuple[int, ...] = ()  # the generation config's end-of-sequence ids


class Runner(Generic[StateT]):
    """Owns the model and its one live state; runs jobs one at a time."""

    def __init__(
        self,
        model: ModelLike[StateT],
        tokenizer: TokenizerLike,
        encoder: PromptEncoder,
        cache: PrefixCache | None,
        counters: Counters,
        options: RunnerOptions,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._encoder = encoder
        self._cache = cache
        self._counters = counters
        self._options = options
        self._vocab = int(model.config.vocab_size)
        self._eos_id = int(tokenizer.eos_id)
        # Generation ends on the tokenizer's end of turn, every eos id of the model config
        # and of the generation config, and any special token outside the answer grammar.
        self._stop_ids = frozenset({
            self._eos_id, *(int(t) for t in model.config.eos_token_ids),
            *options.eos_token_ids, *tokenizer.turn_ending_ids,
        })
        # Ids the tokenizer can decode; the model's padding rows beyond it are never sampled.
        self._sample_limit = min(self._vocab, int(tokenizer.vocab_size))
        self._state = model.new_state()
        self._empty = self._state.snapshot()

    # -- model calls ---------------------------------------------------------------

    @property
    def model(self) -> ModelLike[StateT]:
        return self._model

    def _forward(self, ids: Sequence[int]) -> np.ndarray:
        """Logits row after the last of ``ids``; a model error becomes EngineFailure."""
        try:
            return self._model.forward(ids, self._state, last_only=True)[-1]
        except Exception as exc:
            self._recover()
            raise EngineFailure(f"model failure: {type(exc).__name__}: {exc}") from exc

    def _recover(self) -> None:
        """After a failed model call the live state may be half-updated: start clean."""
        with self._counters.lock:
            self._counters.npu_errors += 1
        try:
            self._state = self._model.new_state()
        except Exception:  # keep the old object; it is restored before every request
            log.exception("engine: cannot create a fresh state after a model failure")

    def _snapshot(self, ids: Sequence[int], logits: np.ndarray, note: str = "") -> None:
        if self._cache is None:
            return
        try:
            self._cache.insert(ids, self._state.snapshot(), logits, note)
        except Exception:  # the cache is an optimisation: never fail a request for it
            log.exception("engine: snapshot at %d tokens failed", len(ids))

    # -- one request ---------------------------------------------------------------

    def run(self, job: Job) -> None:
        ids = job.prompt.ids
        with self._counters.lock:
            self._counters.requests += 1
            self._counters.prompt_tokens += len(ids)
        try:
            depth, logits = self._prefill(job)
            log.debug(
                "engine: %d prompt tokens, %d restored from the cache (%d spliced), %d evaluated",
                len(ids),
                depth,
                job.prompt.spliced_tokens,
                len(ids) - depth,
            )
            decoded = self._decode(job, logits, depth)
        except Cancelled:
            self.count_cancelled()
            return
        except (EngineFailure, InvalidRequest) as exc:  # the latter: a grammar broke mid-way
            job.emit(exc)
            return
        except FloatingPointError as exc:  # the sampler saw NaN/inf logits
            self._recover()
            job.emit(EngineFailure(f"model failure: {exc}"))
            return
        # The transcript is learnt before the client hears of the end, so a next turn sent
        # at once already reuses the generated ids; the end-of-turn snapshot follows and is
        # in place before the worker takes that next request.
        remembered = self._remember_turn(job, decoded)
        job.emit(decoded.finished)
        if remembered is not None:
            self._snapshot_turn(*remembered)

    def count_cancelled(self) -> None:
        with self._counters.lock:
            self._counters.cancelled += 1

    def _resume(self, ids: list[int]) -> tuple[int, np.ndarray | None]:
        hit = self._cache.lookup(ids) if self._cache is not None else None
        if hit is None:
            self._state.restore(self._empty)
            return 0, None
        try:
            self._state.restore(hit.snapshot)
        except Exception:
            log.exception("engine: cached snapshot could not be restored; evaluating cold")
            self._state = self._model.new_state()
            return 0, None
        with self._counters.lock:
            self._counters.cache_hits += 1
            self._counters.cache_tokens_reused += hit.depth
        return hit.depth, (hit.logits if hit.depth == len(ids) else None)

    def _checkpoints(self, ids: list[int], depth: int) -> list[int]:
        """Turn boundaries (just after an end-of-turn id) worth a snapshot, then the end.

        The first boundary ends the system/tools header (shared by every conversation with
        the same tools); the last two start the final messages (an edited or regenerated
        last turn resumes there). Boundaries closer than ``checkpoint_min_tokens`` to the
        resume point, to each other or to the end of the prompt are skipped, except the
        header's from the end: an agent's next session sends the same header with a new,
        often short, question, and must find the header cached."""
        gap = self._options.checkpoint_min_tokens
        boundaries = [p + 1 for p, t in enumerate(ids[:-1]) if t == self._eos_id]
        header = boundaries[0] if boundaries else None
        chosen: list[int] = []
        for p in sorted(set(boundaries[:1] + boundaries[-2:])):
            if p <= depth:
                continue
            last = chosen[-1] if chosen else depth
            room = len(ids) - p >= gap or p == header
            if p - last >= gap and room and p not in chosen:
                chosen.append(p)
        return [*chosen, len(ids)]

    def _prefill(self, job: Job) -> tuple[int, np.ndarray]:
        ids = job.prompt.ids
        depth, logits = self._resume(ids)
        if logits is not None:
            return depth, logits
        t0 = time.perf_counter()
        pos = depth
        chunk = self._options.prefill_chunk
        for target in self._checkpoints(ids, depth):
            while pos < target:
                if job.cancel.is_set():
                    self._count_prefill(pos - depth, t0)
                    raise Cancelled
                end = min(pos + chunk, target)
                logits = self._forward(ids[pos:end])
                pos = end
            assert logits is not None
            self._snapshot(ids[:pos], logits)
        self._count_prefill(pos - depth, t0)
        assert logits is not None
        return depth, logits

    def _count_prefill(self, tokens: int, t0: float) -> None:
        with self._counters.lock:
            self._counters.prefill_tokens += tokens
            self._counters.prefill_seconds += time.perf_counter() - t0

    def _decode(
        self, job: Job, logits: np.ndarray, depth: int
    ) -> Decoded:
        ids = job.prompt.ids
        sampler = Sampler(job.settings, self._sample_limit, ids)
        turn = ParsedTurn(job.parser)
        decoder = self._tokenizer.stream_decoder()
        stopper = StopMatcher(job.stops)
        limit = self._options.max_context - len(ids)
        if job.max_tokens is not None:
            limit = min(limit, job.max_tokens)
        generated: list[int] = []
        pieces: list[str] = []
        pending: list[int] = []
        reason: str = "length"
        t0 = time.perf_counter()
        evaluated = 0
        forwarded = 0  # generated ids the model has evaluated
        constraint = job.constraint
        try:
            while True:
                if job.cancel.is_set():
                    raise Cancelled
                row = logits[: self._sample_limit]
                if constraint is not None:
                    row = constraint.mask(row)
                token = sampler.sample(row)
                # Tokens the grammar forces after the sampled one join it in one model call.
                batch = [token, *constraint.advance(token)] if constraint is not None else [token]
                done = False
                for token in batch:
                    sampler.accept(token)
                    generated.append(token)
                    if token in self._stop_ids:
                        reason = "eos"
                        done = True
                        break
                    pending.append(token)
                    text = stopper.feed(decoder.feed(token))
                    if text:
                        pieces.append(text)
                        for event in turn.feed(TextDelta(text, tuple(pending))):
                            job.emit(event)
                        pending = []
                    if stopper.stopped:
                        reason = "stop_string"
                        done = True
                        break
                    if len(generated) >= limit:
                        done = True
                        break
                if done:
                    break
                logits = self._forward(batch)
                evaluated += len(batch)
                forwarded = len(generated)
        finally:
            with self._counters.lock:
                self._counters.decode_tokens += evaluated
                self._counters.decode_seconds += time.perf_counter() - t0
                self._counters.completion_tokens += len(generated)
        if not stopper.stopped:
            tail = stopper.feed(decoder.finish())
            tail += stopper.flush()
            if stopper.stopped:
                reason = "stop_string"
            if tail:
                pieces.append(tail)
                for event in turn.feed(TextDelta(tail, tuple(pending))):
                    job.emit(event)
        for event in turn.finish():
            job.emit(event)
        text = "".join(pieces)
        # A string value the budget's bound cut (docs/serving.md 9) is a truncated answer
        # too, however the turn then ended.
        cut = constraint is not None and constraint.cut_by_bound
        finish: FinishReason = "length" if reason == "length" or cut else "stop"
        usage = Usage(len(ids), len(generated), depth, turn.reasoning_tokens)
        # Generated ids the model has not evaluated: the last one, or the tail of a batch of
        # grammar-forced ids the limit cut (never evaluated, so the end-of-turn feeds them).
        unevaluated = [t for t in generated[forwarded:] if t not in self._stop_ids]
        matched = stopper.matched if reason == "stop_string" else None
        return Decoded(reason, generated, unevaluated, turn,
                       Finished(finish, usage, text, stop=matched))

    def _remember_turn(
        self, job: Job, decoded: Decoded
    ) -> tuple[list[int], list[int], Transcript] | None:
        """Record the finished turn for generated-id reuse; returns what the end-of-turn
        snapshot needs (token path, ids still to feed, transcript), or None."""
        generated, turn, text = decoded.generated, decoded.turn, decoded.finished.text
        if decoded.reason == "eos":
            body = generated[:-1]
        elif decoded.reason == "length" and generated:
            body = generated
        else:  # a stop string cut the text mid-token: the next turn cannot line up
            return None
        feed = [*decoded.unevaluated, self._eos_id]
        prompt = job.prompt
        full = [*prompt.ids, *body, self._eos_id]
        if len(full) > self._options.max_context:
            return None
        record = self._encoder.remember(prompt, _history_form(turn, text), body, self._eos_id)
        return full, feed, record

    def _snapshot_turn(self, full: list[int], feed: list[int], record: Transcript) -> None:
        """Feed the end-of-turn marker and snapshot where the next turn will continue."""
        if self._cache is None:
            return
        t0 = time.perf_counter()
        try:
            logits = self._forward(feed)
        except EngineFailure:
            log.exception("engine: end-of-turn evaluation failed; no snapshot for this turn")
            return
        with self._counters.lock:
            self._counters.decode_tokens += len(feed)
            self._counters.decode_seconds += time.perf_counter() - t0
        self._snapshot(full, logits, self._encoder.note_of(record))


def _history_form(turn: ParsedTurn, text: str) -> str:
    """The text the next request will carry for this turn: the parser's history form of
    what it already parsed while streaming, else the generated text itself."""
    try:
        canonical = turn.history_text(text)
    except Exception:  # a hint only: never lose the turn's transcript over it
        log.exception("engine: history_text failed; keeping the generated text")
        return text
    return text if canonical is None else canonical


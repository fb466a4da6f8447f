"""The engine the server talks to: admission, a FIFO queue and one worker thread.

The model (and on the board the NPU) is owned by a single worker thread, so requests are
served strictly in arrival order and never interleave on the device. numpy and the NPU
runtime release the GIL while they compute, so the asyncio loop stays responsive. Events
cross from the worker to the consuming coroutine through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from ling3_rknn.chat import markers
from ling3_rknn.chat.events import Admitted, Finished, GenerationEvent
from ling3_rknn.memory_plan import MemoryPlan
from ling3_rknn.tokenizer import TooManyTokens

from .api import (
    ContextLengthExceeded,
    EngineBusy,
    EngineFailure,
    EngineShutDown,
    EngineStats,
    GenerationRequest,
    GrammarSource,
    InvalidRequest,
    SegmentLike,
)
from .cache import PrefixCache, SnapshotStore, model_fingerprint
from .call_guard import BanRows, LazyCalls, MarkerBan
from .grammar_constraint import GrammarCompiler, TokenConstraint
from .options import EngineOptions
from .prompt_encoder import EncodedPrompt, PromptEncoder
from .protocols import ModelLike, TokenizerLike
from .runner import Counters, Job, Runner, RunnerOptions
from .sampler import resolve_settings

log = logging.getLogger(__name__)


class Engine:
    """Implements ``EngineProtocol`` on a model and a tokenizer."""

    def __init__(
        self, model: ModelLike[Any], tokenizer: TokenizerLike, options: EngineOptions
    ) -> None:
        self.model_id = options.model_id
        self.max_context = options.max_context
        # how its loader sized the cache and the prefill scratch (``loading.make_engine``)
        self.memory_plan: MemoryPlan | None = None
        self._defaults = options.generation_defaults
        # A request without max_tokens gets this cap: one runaway answer would otherwise
        # hold the single-stream device until the context is full (README, "Serving").
        self.default_max_tokens = options.default_max_tokens
        self._max_queue = options.max_queue
        self._tokenizer = tokenizer
        self._encoder = PromptEncoder(tokenizer, _eos_text(tokenizer))
        self._cache = self._build_cache(model, options)
        if self._cache is not None:  # turns generated before a restart still splice
            for path, note in self._cache.notes():
                self._encoder.restore_note(note, path)
        self._counters = Counters()
        self._grammars = GrammarCompiler(tokenizer, cache_bytes=options.grammar_cache_bytes)
        self._grammars.prepare()
        self._ban_rows = BanRows()
        self._runner = Runner(
            model,
            tokenizer,
            self._encoder,
            self._cache,
            self._counters,
            RunnerOptions(options.max_context, options.prefill_chunk,
                          options.checkpoint_min_tokens,
                          tuple(int(t) for t in options.eos_token_ids)),
        )
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._admission = threading.Condition()
        self._waiting = 0  # admitted, not yet picked up by the worker
        self._in_flight = 0  # queued or running (including post-generation snapshots)
        self._closed = False
        self._current: Job | None = None
        self._worker = threading.Thread(target=self._work, name="ling3-engine", daemon=True)
        self._worker.start()

    @staticmethod
    def _build_cache(model: ModelLike[Any], options: EngineOptions) -> PrefixCache | None:
        if options.cache_bytes <= 0:
            return None
        if options.cache_dir is None:
            return PrefixCache(options.cache_bytes)
        identity = options.weights_identity
        if identity is None:
            identity = probe_identity(model)
        latent = model.latent_dtype
        if latent != "float32":  # its snapshots are another model's: a store of their own
            identity += f"; latent cache {latent}"
        store = SnapshotStore(options.cache_dir, model_fingerprint(model.config, identity))
        return PrefixCache(
            options.cache_bytes,
            store=store,
            to_arrays=lambda snap: snap.blocked_arrays(),  # frozen latent blocks as they are
            from_arrays=model.snapshot_from_arrays,
            max_disk_bytes=options.cache_disk_bytes,
        )

    # -- EngineProtocol ------------------------------------------------------------

    @property
    def model(self) -> Any:
        """The model the worker runs (the bench times its stages and experts in place)."""
        return self._runner.model

    @property
    def ready(self) -> bool:
        return not self._closed and self._worker.is_alive()

    def stats(self) -> EngineStats:
        c = self._counters
        cache = self._cache.counters() if self._cache is not None else None
        with c.lock:
            return EngineStats(
                requests=c.requests,
                prompt_tokens=c.prompt_tokens,
                completion_tokens=c.completion_tokens,
                prefill_tokens=c.prefill_tokens,
                prefill_seconds=c.prefill_seconds,
                decode_tokens=c.decode_tokens,
                decode_seconds=c.decode_seconds,
                cache_hits=c.cache_hits,
                cache_tokens_reused=c.cache_tokens_reused,
                cache_bytes=cache.bytes_held if cache else 0,
                queue_depth=self._waiting,
                npu_errors=c.npu_errors,
                cache_entries=cache.entries if cache else 0,
                cache_disk_bytes=cache.disk_bytes if cache else 0,
                cancelled=c.cancelled,
                grammar_cache_bytes=self._grammars.bytes_held,
                grammar_cache_entries=self._grammars.entries,
            )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        if not self.ready:
            raise EngineShutDown("the engine is shut down")
        settings = resolve_settings(request.sampling, self._defaults)
        if request.max_tokens is not None and request.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        stops = tuple(request.stop)
        if any(not isinstance(s, str) for s in stops):
            raise InvalidRequest("stop must be strings")
        self._refuse_on_length(request.prompt)
        with self._admission:
            if self._waiting >= self._max_queue:
                raise EngineBusy(f"{self._waiting} requests are already waiting")
            self._waiting += 1
        admitted = True
        try:
            prompt = await self._encode_bounded(request.prompt)
            if not prompt.ids:
                raise InvalidRequest("the prompt is empty")
            # The answer's token budget: what the client asked (or the default cap),
            # never more than the room the prompt leaves.
            room = self.max_context - len(prompt.ids)
            wanted = request.max_tokens if request.max_tokens is not None else (
                self.default_max_tokens)
            budget = room if wanted is None else min(wanted, room)
            constraint: TokenConstraint | LazyCalls | MarkerBan | None = None
            if request.grammar is not None:
                constraint = await asyncio.to_thread(
                    self._constraint, request.grammar, request.banned_markers,
                    request.once_markers, budget)
            elif request.banned_markers or request.once_markers:
                constraint = MarkerBan(self._ban_rows, self._marker_ids(request.banned_markers),
                                       self._marker_ids(request.once_markers))
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()

            def emit(event: GenerationEvent | BaseException) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, event)
                except RuntimeError:  # the consumer's loop is gone
                    job.cancel.set()

            job = Job(
                prompt, settings, budget, stops, emit,
                parser=request.parser, constraint=constraint,
            )
            with self._admission:
                self._in_flight += 1
            self._jobs.put(job)
            admitted = False  # the worker now owns the waiting count
        finally:
            if admitted:
                with self._admission:
                    self._waiting -= 1
        try:
            yield Admitted(len(prompt.ids))
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            job.cancel.set()  # no-op once finished; stops the worker within one token

    async def count_prompt(self, segments: Sequence[SegmentLike]) -> int:
        """The tokens ``generate`` would evaluate or restore for ``segments``, under the
        same bounds as its admission (so a count costs what a refusal does)."""
        self._refuse_on_length(segments)
        return len((await self._encode_bounded(segments)).ids)

    async def _encode_bounded(self, segments: Sequence[SegmentLike]) -> EncodedPrompt:
        """The one way client text becomes ids: in a worker thread (encoding a long prompt
        must not stall the event loop), stopping early once the prompt cannot fit the
        context (ContextLengthExceeded), and stopping between pieces once the awaiting
        task is cancelled (its client left), so no thread encodes for nobody. Call
        ``_refuse_on_length`` first: that bound needs no encoding at all."""
        stopped = threading.Event()
        try:
            prompt = await asyncio.to_thread(
                self._encoder.encode, list(segments), self.max_context - 1, stopped.is_set)
        except asyncio.CancelledError:
            stopped.set()
            raise
        except TooManyTokens as exc:  # stopped early: the prompt cannot fit
            raise ContextLengthExceeded(exc.at_least, self.max_context,
                                        at_least=True) from None
        except (ValueError, TypeError, AttributeError) as exc:  # e.g. TokenizerError
            raise InvalidRequest(f"the prompt cannot be encoded: {exc}") from exc
        if len(prompt.ids) >= self.max_context:
            raise ContextLengthExceeded(len(prompt.ids), self.max_context)
        return prompt

    def _refuse_on_length(self, prompt: Sequence[SegmentLike]) -> None:
        """A prompt whose length alone proves it cannot fit is refused before any encoding
        (a token is at most ``max_token_bytes`` long, so N characters are at least
        N / max_token_bytes tokens): a 15 MB prompt costs a sum of lengths, not a minute
        of BPE and gigabytes of ids."""
        longest = self._tokenizer.max_token_bytes
        if longest < 1:
            return
        floor = -(-sum(len(seg.text) for seg in prompt) // longest)
        if floor >= self.max_context:
            raise ContextLengthExceeded(floor, self.max_context, at_least=True)

    def _constraint(
        self, request_grammar: GrammarSource, banned_markers: Sequence[str],
        once_markers: Sequence[str], budget: int,
    ) -> TokenConstraint | LazyCalls | MarkerBan:
        """A request's per-token constraint (worker-thread objects, built off the loop):
        its grammar for ``budget`` tokens, entered at its trigger when it is lazy."""
        grammar = request_grammar.with_budget(budget)
        trigger = grammar.trigger
        if trigger is None:
            return self._grammars.compile(grammar)
        ban = MarkerBan(self._ban_rows, self._marker_ids(banned_markers),
                        self._marker_ids(once_markers))
        trigger_id = self._tokenizer.special_ids.get(trigger)
        try:
            if trigger_id is None:
                raise InvalidRequest(f"{trigger} is not a token of this model")
            compiled = self._grammars.compile(grammar)
        except InvalidRequest as exc:
            # A lazy grammar only guards what used to be free: it never refuses a request.
            log.warning("engine: calls stay unconstrained for this request: %s", exc)
            return ban
        return LazyCalls(compiled, int(trigger_id), ban)

    def _marker_ids(self, spellings: Sequence[str]) -> list[int]:
        ids = self._tokenizer.special_ids
        return [int(ids[m]) for m in spellings if m in ids]

    def encode_prompt(self, segments: Sequence[SegmentLike]) -> list[int]:
        """The ids the engine would evaluate for ``segments``, generated-id splices included
        (diagnostics: shows why a turn hits or misses the prefix cache)."""
        return self._encoder.encode(list(segments)).ids

    # -- lifecycle -----------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running (post-generation work included)."""
        with self._admission:
            return self._admission.wait_for(lambda: self._in_flight == 0, timeout)

    async def idle(self, timeout: float | None = None) -> bool:
        """``wait_idle`` for coroutines; also flushes pending cache writes to disk."""
        done = await asyncio.to_thread(self.wait_idle, timeout)
        if done and self._cache is not None:
            await asyncio.to_thread(self._cache.flush)
        return done

    def close(self) -> None:
        """Cancel the running request, drop queued ones, stop the worker, flush writes."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(EngineShutDown("the engine is shutting down"))
                with self._admission:
                    self._waiting -= 1
                    self._in_flight -= 1
                    self._admission.notify_all()
        current = self._current
        if current is not None:
            current.cancel.set()
            current.emit(EngineShutDown("the engine is shutting down"))  # unblock its consumer
        self._jobs.put(None)
        self._worker.join()
        if self._cache is not None:
            self._cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker --------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._admission:
                self._waiting -= 1
            self._current = job
            try:
                if not job.cancel.is_set():
                    self._runner.run(job)
                else:  # its client left while it waited: cancelled all the same
                    self._runner.count_cancelled()
            except BaseException as exc:  # keep the worker alive whatever happens
                log.exception("engine: request failed unexpectedly")
                job.emit(EngineFailure(f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                self._current = None
                with self._admission:
                    self._in_flight -= 1
                    self._admission.notify_all()


def probe_identity(model: ModelLike[Any], probe_tokens: int = 8) -> str:
    """Identity of the weights when the caller gives none (e.g. no bundle manifest hash):
    a digest of the logits of a fixed probe sequence. Two checkpoints with the same config
    but different weights must never share persisted snapshots; this tells them apart for
    the price of one tiny forward pass at start-up."""
    vocab = int(model.config.vocab_size)
    ids = list(range(min(probe_tokens, vocab)))
    logits = np.asarray(model.forward(ids, model.new_state()), dtype=np.float64)
    digest = hashlib.sha256(np.round(logits, 4).tobytes()).hexdigest()
    return f"probe-logits:{digest}"


def _eos_text(tokenizer: TokenizerLike) -> str:
    try:
        text = tokenizer.decode([tokenizer.eos_id])
    except Exception:
        return markers.ROLE_END
    return text or markers.ROLE_END


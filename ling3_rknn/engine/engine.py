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
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ling3_rknn.chat import markers
from ling3_rknn.chat.events import Admitted, Finished, GenerationEvent
from ling3_rknn.tokenizer import TooManyTokens

from .api import (
    ContextLengthExceeded,
    EngineBusy,
    EngineFailure,
    EngineShutDown,
    EngineStats,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    SegmentLike,
)
from .call_guard import BanRows, LazyCalls, MarkerBan
from .grammar_constraint import DEFAULT_GRAMMAR_CACHE_BYTES, GrammarCompiler
from .prefix_cache import PrefixCache
from .prompt_encoder import PromptEncoder
from .runner import Counters, Job, ModelLike, Runner, RunnerOptions, TokenizerLike
from .sampler import LING3_GENERATION_DEFAULTS, resolve_settings
from .snapshot_store import SnapshotStore, model_fingerprint

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 2 << 30  # 2 GiB: ~100 snapshots of the real model's ~20 MB state
# Output tokens of a request that names no max_tokens (``serve --default-max-tokens``): at
# ~20 tokens/s on the board, a runaway answer holds the single stream ~3.5 minutes instead
# of the ~27 a 32K context would take (README, "Serving").
DEFAULT_MAX_TOKENS = 4096


class Engine:
    """Implements ``EngineProtocol`` on a model and a tokenizer."""

    def __init__(
        self,
        model: ModelLike,
        tokenizer: TokenizerLike,
        *,
        model_id: str,
        max_context: int,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_disk_bytes: int | None = None,
        weights_identity: str | None = None,
        generation_defaults: SamplingParams = LING3_GENERATION_DEFAULTS,
        max_queue: int = 16,
        prefill_chunk: int = 64,
        checkpoint_min_tokens: int = 64,
        snapshot_from_arrays: Callable[[Mapping[str, np.ndarray]], Any] | None = None,
        eos_token_ids: Sequence[int] = (),
        grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
    ) -> None:
        if max_context < 2:
            raise ValueError("max_context must be at least 2")
        if default_max_tokens is not None and default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1 (None: no cap)")
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.model_id = model_id
        self.max_context = max_context
        self._defaults = generation_defaults
        # A request without max_tokens gets this cap: one runaway answer would otherwise
        # hold the single-stream device until the context is full (README, "Serving").
        self.default_max_tokens = default_max_tokens
        self._max_queue = max_queue
        self._tokenizer = tokenizer
        self._encoder = PromptEncoder(tokenizer, _eos_text(tokenizer))
        self._cache = self._build_cache(
            model, cache_bytes, cache_dir, cache_disk_bytes, weights_identity, snapshot_from_arrays
        )
        if self._cache is not None:  # turns generated before a restart still splice
            for path, note in self._cache.notes():
                self._encoder.restore_note(note, path)
        self._counters = Counters()
        self._grammars = GrammarCompiler(tokenizer, cache_bytes=grammar_cache_bytes)
        self._grammars.prepare()
        self._ban_rows = BanRows()
        self._runner = Runner(
            model,
            tokenizer,
            self._encoder,
            self._cache,
            self._counters,
            RunnerOptions(max_context, prefill_chunk, checkpoint_min_tokens,
                          tuple(int(t) for t in eos_token_ids)),
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
    def _build_cache(
        model: ModelLike,
        cache_bytes: int,
        cache_dir: str | os.PathLike[str] | None,
        cache_disk_bytes: int | None,
        weights_identity: str | None,
        snapshot_from_arrays: Callable[[Mapping[str, np.ndarray]], Any] | None,
    ) -> PrefixCache | None:
        if cache_bytes <= 0:
            return None
        if cache_dir is None:
            return PrefixCache(cache_bytes)
        if snapshot_from_arrays is None:
            snapshot_from_arrays = _model_snapshot_reader(model)
        if weights_identity is None:
            weights_identity = probe_identity(model)
        latent = getattr(model, "latent_dtype", "float32")
        if latent != "float32":  # its snapshots are another model's: a store of their own
            weights_identity += f"; latent cache {latent}"
        store = SnapshotStore(cache_dir, model_fingerprint(model.config, weights_identity))
        return PrefixCache(
            cache_bytes,
            store=store,
            to_arrays=lambda snap: snap.blocked_arrays(),  # frozen latent blocks as they are
            from_arrays=snapshot_from_arrays,
            max_disk_bytes=cache_disk_bytes,
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
            try:
                prompt = await asyncio.to_thread(
                    self._encoder.encode, list(request.prompt), self.max_context - 1)
            except TooManyTokens as exc:  # stopped early: the prompt cannot fit
                raise ContextLengthExceeded(exc.at_least, self.max_context,
                                            at_least=True) from None
            except (ValueError, TypeError, AttributeError) as exc:  # e.g. TokenizerError
                raise InvalidRequest(f"the prompt cannot be encoded: {exc}") from exc
            if not prompt.ids:
                raise InvalidRequest("the prompt is empty")
            if len(prompt.ids) >= self.max_context:
                raise ContextLengthExceeded(len(prompt.ids), self.max_context)
            # The answer's token budget: what the client asked (or the default cap),
            # never more than the room the prompt leaves.
            room = self.max_context - len(prompt.ids)
            wanted = request.max_tokens if request.max_tokens is not None else (
                self.default_max_tokens)
            budget = room if wanted is None else min(wanted, room)
            constraint = None
            if request.grammar is not None:
                constraint = await asyncio.to_thread(self._constraint, request, budget)
            elif request.banned_markers:
                constraint = MarkerBan(self._ban_rows, self._marker_ids(request.banned_markers))
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

    def _refuse_on_length(self, prompt: Sequence[SegmentLike]) -> None:
        """A prompt whose length alone proves it cannot fit is refused before any encoding
        (a token is at most ``max_token_bytes`` long, so N characters are at least
        N / max_token_bytes tokens): a 15 MB prompt costs a sum of lengths, not a minute
        of BPE and gigabytes of ids."""
        longest = getattr(self._tokenizer, "max_token_bytes", None)
        if not longest:
            return
        floor = -(-sum(len(seg.text) for seg in prompt) // longest)
        if floor >= self.max_context:
            raise ContextLengthExceeded(floor, self.max_context, at_least=True)

    def _constraint(self, request: GenerationRequest, budget: int) -> Any:
        """The request's per-token constraint (worker-thread objects, built off the loop):
        its grammar for ``budget`` tokens, entered at its trigger when it is lazy."""
        grammar = request.grammar
        with_budget = getattr(grammar, "with_budget", None)
        if with_budget is not None:
            grammar = with_budget(budget)
        trigger = getattr(grammar, "trigger", None)
        if trigger is None:
            return self._grammars.compile(grammar)
        ban = MarkerBan(self._ban_rows, self._marker_ids(request.banned_markers))
        trigger_id = self._tokenizer_ids().get(trigger)
        try:
            if trigger_id is None:
                raise InvalidRequest(f"{trigger} is not a token of this model")
            compiled = self._grammars.compile(grammar)
        except InvalidRequest as exc:
            # A lazy grammar only guards what used to be free: it never refuses a request.
            log.warning("engine: calls stay unconstrained for this request: %s", exc)
            return ban
        return LazyCalls(compiled, int(trigger_id), ban)

    def _tokenizer_ids(self) -> Mapping[str, int]:
        return getattr(self._tokenizer, "special_ids", None) or {}

    def _marker_ids(self, spellings: Sequence[str]) -> list[int]:
        ids = self._tokenizer_ids()
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


def probe_identity(model: ModelLike, probe_tokens: int = 8) -> str:
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


def _model_snapshot_reader(model: ModelLike) -> Callable[[Mapping[str, np.ndarray]], Any]:
    """The model's own snapshot reader (``Model.snapshot_from_arrays``: its config and
    latent-cache dtype), else ``StateSnapshot.from_arrays`` for its config (imported lazily
    so the engine can be unit-tested with a scripted model double)."""
    reader = getattr(model, "snapshot_from_arrays", None)
    if reader is not None:
        return reader
    from ling3_rknn.model import StateSnapshot

    config = model.config
    return lambda arrays: StateSnapshot.from_arrays(config, arrays)

"""``Model``: the forward loop tying the stage backend, the CPU glue and the sequence state."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..bundle import Bundle, VerifyMode
from ..config import ModelConfig
from ..cpu_threads import apply_thread_policy
from ..npu.matmul_plan import MatmulError
from . import native
from .backend import NumpyStages, StageBackend
from .bundle_loader import ExecutorChoice, load_bundle_parts, runtime_for
from .checkpoint import Checkpoint
from .cpu_weights import CpuWeights
from .kda import kda_core, kda_decode, prepare_qkv, short_conv
from .mla import apply_rope, mla_attention, rope_angles
from .mla_expanded import (
    CPU_ROWS,
    PREFILL_SCRATCH_BYTES,
    ExpandedRows,
    ProjectedRows,
    expanded_attention,
)
from .mla_npu import NpuAttention, NpuPrefillChoice, NpuRows, open_npu_attention
from .moe import ExpertBackend, NumpyExperts, route
from .pipeline import run_wavefront

if TYPE_CHECKING:
    from ..npu.matmul_experts import MatmulExpertStore
from .snapshot_arrays import SnapshotArrays
from .stages import LayerOutput
from .state import (
    LatentCache,
    SequenceState,
    StateError,
    StateLayout,
    StateSnapshot,
    check_latent_dtype,
)
from .weights import CheckpointWeights

# Set to 1: a decode token's KDA heads are shared out over the glue threads
# (``Model.kda_decode_split``; slower on the host, to be measured on the board:
# docs/performance.md, "KDA step").
KDA_DECODE_SPLIT_ENV = "LING3_RKNN_KDA_DECODE_SPLIT"

log = logging.getLogger(__name__)


# Tokens per prefill forward when the stages take any length (numpy) or only small graphs.
DEFAULT_PREFILL_CHUNK = 64

# A call of at most one pipeline piece still runs as two halves in flight when each half has
# at least this many tokens: a later agent turn (~500 tokens at 17K depth) is ~1.1 s of NPU
# and ~0.9 s of CPU one after the other (docs/performance.md, "Prefill budget"); in flight
# they overlap, for ~0.2 s more of the routed experts' weight reads (each half reads them).
PIPELINE_MIN_PIECE = 192


class Model:
    """Ling-3.0 forward pass. ``forward`` on a whole sequence or on its pieces gives the same
    logits; the state carries everything between calls."""

    def __init__(
        self,
        config: ModelConfig,
        stages: StageBackend,
        experts: ExpertBackend,
        cpu: CpuWeights,
        *,
        threads: int = 1,
        bundle: Bundle | None = None,
        latent_dtype: str = "float32",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        npu_graphs: bool = False,
        npu_attention: NpuAttention | None = None,
        npu_matmul_experts: MatmulExpertStore | None = None,
    ) -> None:
        self.config = config
        self.bundle = bundle  # the bundle it was loaded from (``from_bundle``), else None
        self.npu_graphs = npu_graphs  # its stages run from the bundle's .rknn files
        # the routed experts' int8 copy in NPU memory for prefill (``from_bundle``), else None
        self.npu_matmul_experts = npu_matmul_experts
        self.stages = stages
        self.experts = experts
        self.cpu = cpu
        self.threads = threads
        # tokens per prefill forward the engine should feed: a bundle's largest graph shape
        self.prefill_chunk = prefill_chunk
        # prefill attention's matmuls on the NPU (mla_npu.py); None: the CPU kernel
        self.npu_attention = npu_attention
        # a longer forward runs in pieces of this many tokens, two in flight (pipeline.py);
        # 0: one piece. On with the NPU: each piece's CPU work fills the other's NPU time.
        self.pipeline_piece = 0
        # seconds the pieces in flight ran beyond the wall time they took, summed (read by
        # ``ling3-rknn bench``: the components it times add up to wall time + this)
        self.pipeline_overlap_s = 0.0
        if npu_attention is not None:
            self.pipeline_piece = npu_attention.shapes.query_rows
            self.prefill_chunk = max(prefill_chunk, 2 * self.pipeline_piece)
            npu_attention.prepare(cpu.mla_bases.values())  # its projections, at load
        self._scale = float(config.qk_head_dim) ** -0.5
        self._layout = StateLayout.from_config(config, latent_dtype)
        self.latent_dtype = latent_dtype  # the MLA latent cache's dtype (state.LATENT_DTYPES)
        self._pool: ThreadPoolExecutor | None = None  # glue split (_split_pool), made on use
        self._pipe: ThreadPoolExecutor | None = None  # two prefill pieces in flight
        # bytes one sequence's expanded-prefill rows may take (mla_expanded.py); 0: never
        self.prefill_scratch_bytes = PREFILL_SCRATCH_BYTES
        # share a decode token's KDA heads over the glue threads (off: measured slower here)
        self.kda_decode_split = os.environ.get(KDA_DECODE_SPLIT_ENV, "0") == "1"
        native.available()  # load the installed decode kernels now; logs which glue runs

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str], *, threads: int | None = None,
                latent_dtype: str = "float32") -> Model:
        """Load an HF checkpoint directory (config.json + safetensors), float32 numpy stages.

        Dense weights are read (and checked) now; routed experts stay on disk, memory-mapped,
        and are read when a token is routed to them. ``threads``: the process's CPU thread
        policy (``ling3_rknn.cpu_threads``; None: one per big core).
        """
        policy = apply_thread_policy(threads)
        root = Path(path)
        config = ModelConfig.from_file(root / "config.json")
        weights = CheckpointWeights(Checkpoint.open(root), config)
        stages = NumpyStages(weights)
        stages.load_all()
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                weights.check_experts(i)
        return cls(
            config, stages, NumpyExperts(weights.expert), CpuWeights.from_checkpoint(weights),
            threads=policy.threads, latent_dtype=latent_dtype,
        )

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike[str] | Bundle,
        *,
        executor: ExecutorChoice = "auto",
        verify: VerifyMode = "stamped",
        threads: int | None = None,
        latent_dtype: str = "float32",
        npu_prefill: NpuPrefillChoice = "auto",
        npu_experts: bool = False,
    ) -> Model:
        """Load a converted bundle (a path, or an opened ``Bundle``): stage graphs on
        RKNNLite (the board, or its ONNX-twin mock on a host; ``executor`` = auto |
        rknnlite | mock | onnx), routed experts on the CPU kernels and the NPU experts of
        the placement plan. Every file is checked against the manifest's sha256 first
        (``verify``: stamped | full | size | none, see ``Bundle.verify``). ``threads``
        sizes every CPU pool (routed experts, CPU stage graphs) and pins them; see
        ``ling3_rknn.cpu_threads`` (None: one per big core). ``latent_dtype``: the MLA
        latent cache in float32 or float16 (half the memory, ``state.LATENT_DTYPES``).
        ``npu_prefill``: prefill attention's matmuls on the NPU (``mla_npu``: auto = on a
        board, on = also on the host stand-in, off). ``npu_experts``: prefill pieces run the
        routed experts' int8 copy on the NPU's matmuls (the bundle must carry it; whether a
        board can afford it is the memory plan's call, ``ling3_rknn.loading``); decode stays
        on the CPU experts."""
        runtime = runtime_for(executor)  # a bad choice fails before any file is read
        check_latent_dtype(latent_dtype)  # before any file is read, like the executor
        policy = apply_thread_policy(threads)
        if isinstance(path, Bundle):
            bundle = path
            if verify != "none":
                bundle.verify(verify)
        else:
            bundle = Bundle.open(path, verify=verify)
        parts = load_bundle_parts(bundle, executor, policy.threads, npu_experts=npu_experts)
        on_npu = bundle.manifest.target == "rk3588" and runtime != "onnx"
        choice = npu_prefill if on_npu or npu_prefill != "auto" else "off"
        attention = open_npu_attention(parts.config, choice,
                                       runtime if runtime != "onnx" else None)
        return cls(parts.config, parts.stages, parts.experts, parts.cpu,
                   threads=policy.threads, bundle=bundle, latent_dtype=latent_dtype,
                   prefill_chunk=max(parts.stages.chunk_sizes[-1], DEFAULT_PREFILL_CHUNK),
                   npu_graphs=parts.npu_graphs, npu_attention=attention,
                   npu_matmul_experts=parts.npu_matmul_experts)

    def new_state(self) -> SequenceState:
        return SequenceState(self.config, self.latent_dtype)

    def snapshot_from_arrays(self, arrays: SnapshotArrays) -> StateSnapshot:
        """``StateSnapshot.from_arrays`` for this model's states (config and latent dtype)."""
        return StateSnapshot.from_arrays(self.config, arrays, self.latent_dtype)

    def forward(
        self,
        token_ids: Sequence[int] | np.ndarray,
        state: SequenceState,
        *,
        last_only: bool = False,
    ) -> np.ndarray:
        """Float32 logits [T, vocab] for ``token_ids`` (or [1, vocab] with ``last_only``),
        advancing ``state`` by T tokens. Raises ValueError for empty or out-of-range input
        before touching the state."""
        ids = self._check_ids(token_ids)
        if state.layout != self._layout:
            raise ValueError("state belongs to a model with a different layout")
        state.check_usable()
        end = state.length + len(ids)
        if end > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence would reach {end} tokens, beyond max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        state.broken = True  # cleared only when every layer has been advanced
        expanded = self._expanded_prefill(state, len(ids))
        piece = self.pipeline_piece
        if piece and len(ids) <= piece and len(ids) >= 2 * PIPELINE_MIN_PIECE:
            piece = -(-len(ids) // 2)  # a later turn's few hundred tokens: two halves
        if piece and len(ids) > piece:
            pieces = self._pipelined(ids, state, expanded, piece, last_only)
        else:
            pieces = [self._layers(ids, state, state.length, expanded)]
        if state.prefill_scratch.stale:  # every piece is done with the rows now
            state.prefill_scratch.release()
        state.length = end
        state.broken = False
        if last_only:
            pieces = [pieces[-1][-1:]]
        # the head per piece, as a call per piece would (the same bits)
        logits = [self.stages.final(x) for x in pieces]
        return np.ascontiguousarray(logits[0] if len(logits) == 1 else np.concatenate(logits),
                                    dtype=np.float32)

    def _layers(self, ids: np.ndarray, state: SequenceState, start: int, expanded: bool,
                before: Callable[[int], None] | None = None,
                after: Callable[[int], None] | None = None) -> np.ndarray:
        """``ids`` at positions ``start``.. through every layer: their last hidden states.
        ``before`` / ``after`` bracket each layer (the pipeline's ordering)."""
        x = self.stages.embed(ids)
        # One set of RoPE angles per call, shared by every MLA layer (same positions).
        rope = rope_angles(np.arange(start, start + len(ids)), self.config.qk_rope_head_dim,
                           self.config.rope_theta)
        for i, kind in enumerate(self.config.layer_kinds):
            if before is not None:
                before(i)
            if kind == "kda":
                out = self._kda_layer(i, x, state)
            else:
                out = self._mla_layer(i, x, state, rope, expanded)
            x = out.hidden if out.moe_input is None else self._moe(i, out)
            if after is not None:
                after(i)
        return x

    def _pipelined(self, ids: np.ndarray, state: SequenceState, expanded: bool, piece: int,
                   last_only: bool) -> list[np.ndarray]:
        """``_layers`` over pieces of ``piece`` tokens, two in flight (pipeline.py): each
        piece's last hidden states (only the last piece's with ``last_only``)."""
        starts = list(range(0, len(ids), piece))
        self._split_pool()  # made here, not raced for by the two pieces
        if self._pipe is None:
            self._pipe = ThreadPoolExecutor(2, thread_name_prefix="ling3-pipe")

        def run(p: int, before: Callable[[int], None], after: Callable[[int], None]
                ) -> np.ndarray:
            a = starts[p]
            part = ids[a:a + piece]
            x = self._layers(part, state, state.length + a, expanded, before, after)
            return x[-1:] if last_only and p < len(starts) - 1 else x

        results, overlap = run_wavefront(len(starts), self.config.num_hidden_layers, run,
                                         self._pipe)
        self.pipeline_overlap_s += overlap
        return results[-1:] if last_only else results

    # ----------------------------------------------------------------- layers
    def _kda_layer(self, i: int, x: np.ndarray, state: SequenceState) -> LayerOutput:
        c = self.config
        inp = self.stages.kda_input(i, x)
        if len(x) == 1:
            core = kda_decode(inp.qkv, state.conv[i], self.cpu.conv[i], inp.log_decay,
                              inp.beta, state.recurrent[i], pool=self._decode_pool(),
                              parts=self.threads)
            if core is not None:
                return self.stages.kda_output(i, x, core, inp.out_gate)
        conv_out, state.conv[i] = short_conv(inp.qkv, state.conv[i], self.cpu.conv[i])
        q, k, v = prepare_qkv(conv_out, c.num_attention_heads, c.kda_head_dim)
        core = kda_core(q, k, v, inp.log_decay, inp.beta, state.recurrent[i],
                        pool=self._split_pool(), parts=self.threads)
        return self.stages.kda_output(i, x, core, inp.out_gate)

    def _expanded_prefill(self, state: SequenceState, t: int) -> bool:
        """Whether this call's MLA attention takes the expanded form (mla_expanded.py).
        Decode tokens stay absorbed and keep the projected rows: an agent's next turn
        continues this history (``SequenceState.restore``) and projects only the rows
        added since, inside the ``prefill_scratch_bytes`` the memory plan set aside."""
        if t == 1:
            return False
        return state.prefill_scratch.choose(
            self.cpu.mla_bases, self.config.qk_rope_head_dim, state.length, t,
            self.prefill_scratch_bytes, store=self.npu_attention or CPU_ROWS)

    def _mla_layer(
        self, i: int, x: np.ndarray, state: SequenceState, rope: tuple[np.ndarray, np.ndarray],
        expanded: bool = False,
    ) -> LayerOutput:
        inp = self.stages.mla_input(i, x)
        cos, sin = rope
        q_rope = apply_rope(inp.q_rope, cos, sin)
        k_rope = apply_rope(inp.k_rope, cos, sin)
        cache = state.latents[i]
        cache.append(np.concatenate([inp.latent, k_rope], axis=1))
        ctx = None
        scratch = state.prefill_scratch
        rows = scratch.rows.get(i) if expanded and not scratch.stale else None
        if rows is not None:
            ctx = self._expanded_attention(inp.q_latent, q_rope, rows, cache)
            if ctx is None:  # refused or failed: absorbed from here on, the rows stale
                scratch.stale = True
        if ctx is None:
            ctx = mla_attention(inp.q_latent, q_rope, cache.blocks(), cache.length,
                                self._scale, pool=self._split_pool(), parts=self.threads)
        return self.stages.mla_output(i, x, ctx, inp.gate)

    def _expanded_attention(self, q_latent: np.ndarray, q_rope: np.ndarray,
                            rows: ProjectedRows, cache: LatentCache) -> np.ndarray | None:
        """The expanded form on the rows' own engine: the NPU's matmuls or the CPU kernel,
        after projecting the rows not projected yet (a cached prefix, an absorbed chunk,
        then this chunk's, as the cache stores them: float16 rounded when it is float16).
        None when it cannot run (the chunk then runs absorbed)."""
        if isinstance(rows, NpuRows):
            assert self.npu_attention is not None
            try:
                rows.extend(cache.rows(rows.length, cache.length))
                return self.npu_attention.attend(q_latent, q_rope, rows, cache.length,
                                                 self._scale)
            except MatmulError as exc:  # out of NPU memory included
                log.warning("NPU attention failed (%s): the rest of this call runs on the "
                            "CPU", exc)
                return None
        assert isinstance(rows, ExpandedRows)
        rows.extend(cache.rows(rows.length, cache.length))
        return expanded_attention(q_latent, q_rope, rows, cache.length, self._scale,
                                  pool=self._split_pool(), parts=self.threads)

    def _decode_pool(self) -> ThreadPoolExecutor | None:
        """Threads for a decode token's KDA heads (``kda_decode_split``)."""
        return self._split_pool() if self.kda_decode_split else None

    def _split_pool(self) -> ThreadPoolExecutor | None:
        """Threads for the glue's large calls: prefill KDA heads, long MLA attention."""
        if self.threads < 2:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="ling3-glue")
        return self._pool

    def _moe(self, i: int, out: LayerOutput) -> np.ndarray:
        c = self.config
        moe_input, router_logits = out.moe_input, out.router_logits
        assert moe_input is not None and router_logits is not None  # what makes it MoE
        ids, weights = route(
            router_logits,
            self.cpu.expert_bias[i],
            n_group=c.n_group,
            topk_group=c.topk_group,
            top_k=c.num_experts_per_tok,
            normalize=c.norm_topk_prob,
            scaling=c.routed_scaling_factor,
        )
        return out.hidden + out.shared + self.experts(i, moe_input, ids, weights)

    def _check_ids(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be a flat sequence, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError("token_ids is empty")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[bad][0])} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        return ids.astype(np.int64)


__all__ = ["CpuWeights", "Model", "StateError"]

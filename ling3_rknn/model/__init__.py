"""The Ling-3.0 forward pass (hybrid KDA + MLA, MoE), shaped for an NPU to take over.

Three layers of code, so the NPU work can be swapped in without touching the CPU glue:

1. ``stage_contract.py``: every stage's inputs and outputs and the CPU work around it,
   declared once. ``stages.py``: the stages as pure numpy functions taking their weights
   explicitly, the references the converter's ONNX graphs are tested against. Per layer
   an input stage (RMSNorm + attention input projections; for MLA also the q_a norm, the
   latent norm and the head gate) and an output stage (output projection + post-attention
   RMSNorm + the dense FFN, or the shared expert + router logits); plus the final norm +
   lm_head.
2. CPU glue, which stays on the CPU on the board: ``kda.py`` (short conv + delta-rule
   recurrence, per-token and chunked), ``mla.py`` (RoPE + absorbed attention over the
   latent cache), ``mla_expanded.py`` (a prefill's attention with per-head keys and values,
   3.4x fewer FLOPs, from projected rows kept only through the prefill), ``moe.py``
   (group-limited routing), ``state.py`` (per-sequence state and block-shared snapshots).
   A decode token's KDA step and MLA attention, and a prefill chunk's MLA attention, also
   exist as C kernels (``kda_decode.c``, ``mla_attention.c``; their ABI declared once in
   ``native_abi.h``) that ``native_build.py`` compiles when the package is installed
   (``ling3-rknn build-kernels``) and ``native.py`` loads; the numpy functions stay the
   reference and the fallback.
3. ``model.py``: the forward loop. It calls the stages through the ``StageBackend`` seam
   (``backend.py``: ``NumpyStages`` from a checkpoint; ``bundle_stages.GraphStages``, one
   NPU / onnxruntime graph per stage, from a bundle) and the routed experts through the
   ``ExpertBackend`` seam (``moe.NumpyExperts``; ``bundle_stages.BundleExperts`` over the
   QMoE or ``float_experts`` kernels). ``Model.from_bundle`` gets its pieces from
   ``bundle_loader.py``, which opens the executors through ``bundle_executors.py``.

Public API::

    m = Model.from_hf(hf_dir)            # config.json + *.safetensors; lazy loading
    m = Model.from_bundle(bundle_dir)    # a converted bundle (or an opened ``Bundle``)
    s = m.new_state()
    logits = m.forward(token_ids, s)     # float32 [len(token_ids), vocab]; advances s
    snap = s.snapshot(); s.restore(snap)
    StateSnapshot.from_arrays(m.config, snap.to_arrays())
"""

from .backend import NumpyStages, StageBackend
from .checkpoint import Checkpoint
from .cpu_weights import CpuWeights
from .float_experts import FloatExperts
from .model import Model
from .moe import ExpertBackend, NumpyExperts
from .safetensors_file import CheckpointError
from .state import SequenceState, SnapshotError, StateError, StateSnapshot

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CpuWeights",
    "ExpertBackend",
    "FloatExperts",
    "Model",
    "NumpyExperts",
    "NumpyStages",
    "SequenceState",
    "SnapshotError",
    "StageBackend",
    "StateError",
    "StateSnapshot",
]

"""Sampler, generation loop, prefix cache and the single worker that owns the model.

``Engine`` implements ``api.EngineProtocol`` for the server.
"""

from ling3_rknn.chat.events import Admitted, Finished, GenerationEvent, TextDelta, Usage

from .api import (
    ContextLengthExceeded,
    EngineBusy,
    EngineError,
    EngineFailure,
    EngineProtocol,
    EngineShutDown,
    EngineStats,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    TurnParser,
)
from .engine import Engine
from .sampler import LING3_GENERATION_DEFAULTS, defaults_from_generation_config

__all__ = [
    "LING3_GENERATION_DEFAULTS",
    "Admitted",
    "ContextLengthExceeded",
    "Engine",
    "EngineBusy",
    "EngineError",
    "EngineFailure",
    "EngineProtocol",
    "EngineShutDown",
    "EngineStats",
    "Finished",
    "GenerationEvent",
    "GenerationRequest",
    "InvalidRequest",
    "SamplingParams",
    "TextDelta",
    "TurnParser",
    "Usage",
    "defaults_from_generation_config",
]

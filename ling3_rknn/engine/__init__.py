"""Sampler, generation loop, prefix cache and the single worker that owns the model.

``Engine`` implements ``api.EngineProtocol`` for the server.
"""

from .api import (
    Admitted,
    ContextLengthExceeded,
    EngineBusy,
    EngineError,
    EngineFailure,
    EngineProtocol,
    EngineShutDown,
    EngineStats,
    Finished,
    GenerationEvent,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    TextDelta,
    Usage,
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
    "Usage",
    "defaults_from_generation_config",
]

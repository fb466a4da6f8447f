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
from .options import DEFAULT_MAX_TOKENS, EngineOptions
from .protocols import ModelLike, TokenizerLike
from .sampler import LING3_GENERATION_DEFAULTS, defaults_from_generation_config

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "LING3_GENERATION_DEFAULTS",
    "Admitted",
    "ContextLengthExceeded",
    "Engine",
    "EngineBusy",
    "EngineError",
    "EngineFailure",
    "EngineOptions",
    "EngineProtocol",
    "EngineShutDown",
    "EngineStats",
    "Finished",
    "GenerationEvent",
    "GenerationRequest",
    "InvalidRequest",
    "ModelLike",
    "SamplingParams",
    "TextDelta",
    "TokenizerLike",
    "TurnParser",
    "Usage",
    "defaults_from_generation_config",
]

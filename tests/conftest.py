"""Shared pytest fixtures (keep additions small and generic)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# Property tests check behaviour, never speed: the shared CI machine is noisy, so no
# per-example deadline (a slow example must not fail a correct property).
settings.register_profile("ling3", deadline=None)
settings.load_profile("ling3")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Tiny random Ling-3.0 checkpoints + transformers 5.24.0 reference logits
# (regenerate with tests/oracle/make_fixtures.py).
ORACLE_DIR = FIXTURES / "oracle"
ORACLE_FIXTURES = ("lora_hfsave", "plainq_released", "lora_hfmodule_bf16")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """An HF-style checkpoint directory of a tiny random Ling-3.0 model (vocab 256)."""
    return ORACLE_DIR / ORACLE_FIXTURES[0]

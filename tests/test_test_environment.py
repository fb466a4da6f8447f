"""The test session itself is hermetic: what the runtime writes for itself (bundle check
stamps) and the C kernels the session builds go to a directory of the session's own
(conftest.py), never to the user's ``~/.cache`` or the venv."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ling3_rknn.model import native, native_build
from ling3_rknn.paths import state_directory


def test_the_state_directory_is_the_sessions_own():
    state = state_directory()
    assert "STATE_DIRECTORY" not in os.environ
    assert state.name.startswith("ling3-rknn-test-state-") and state.is_dir()
    assert not state.is_relative_to(Path.cwd())
    assert not state.is_relative_to(Path.home() / ".cache")


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler: nothing is built")
def test_kernels_are_built_into_it():
    """The kernels under test are the session's own build, not the venv's installed ones."""
    assert native.available(), native.status()
    assert native_build.kernel_directory().is_relative_to(state_directory())
    assert native.library_path().is_file()
    assert native.status().startswith(f"compiled ({native.library_path()}; ")

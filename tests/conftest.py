"""Shared pytest fixtures (keep additions small and generic)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from ling3_rknn.model import native_build

# Property tests check behaviour, never speed: the shared CI machine is noisy, so no
# per-example deadline (a slow example must not fail a correct property).
settings.register_profile("ling3", deadline=None)
settings.load_profile("ling3")

_STATE_PREFIX = "ling3-rknn-test-state-"
_STATE_DIR: str | None = None  # made (and removed) by this process


def pytest_configure(config: pytest.Config) -> None:
    """Point the runtime's state directory (bundle check stamps; ``ling3_rknn.paths``) and
    its kernel directory at a directory of this session's own, and build the C kernels
    there from the sources under test, before any test module is imported: some decide
    at import whether the kernels load (``native.available()``), and a test run must
    neither write into nor load from the user's ``~/.cache`` or the venv's installed
    kernels. Servers the tests start, and pytest-xdist's workers, inherit both. Removed at
    the end of the session. Without a C compiler nothing is built and the kernel tests
    skip; a failed build shows in ``native.status()`` (test_native_kernels.py)."""
    global _STATE_DIR
    os.environ.pop("STATE_DIRECTORY", None)  # systemd's name wins over ours (paths.py)
    inherited = os.environ.get("LING3_RKNN_STATE_DIR", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and Path(inherited).name.startswith(_STATE_PREFIX):
        return  # an xdist worker: the controller's directories, removed by the controller
    _STATE_DIR = tempfile.mkdtemp(prefix=_STATE_PREFIX)
    os.environ["LING3_RKNN_STATE_DIR"] = _STATE_DIR
    kernels = Path(_STATE_DIR) / "kernels"
    os.environ[native_build.KERNEL_DIR_ENV] = str(kernels)
    if native_build.compiler() is not None:
        try:
            native_build.build(kernels)
        except native_build.BuildError as exc:
            sys.stderr.write(f"conftest.py: the C kernels did not build: {exc}\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STATE_DIR is not None:
        shutil.rmtree(_STATE_DIR, ignore_errors=True)


_KERNEL_ISAS: dict[str, str] = {}  # -march -> the ISA its build reports, built this session


def _built(directory: Path, march: str) -> str:
    """The ISA of ``march``'s kernels in ``directory``: another xdist worker's build of the
    same sources when there is one, else built now."""
    try:
        manifest = native_build.Manifest.read(directory / native_build.MANIFEST)
        if manifest.mismatch() is None and manifest.flags[-1] == f"-march={march}":
            return manifest.isa
    except (OSError, ValueError, TypeError):
        pass
    return native_build.build(directory, march=march).isa


# LING3_RKNN_TEST_MARCH=native (a comma list) keeps a session to those kernel builds
_TEST_MARCHES = tuple(m for m in os.environ.get("LING3_RKNN_TEST_MARCH", "").split(",") if m
                      ) or native_build.marches_here()


@pytest.fixture(scope="module", params=_TEST_MARCHES)
def kernel_march(request: pytest.FixtureRequest):
    """Run a module's kernel numerics tests on each kernel build this machine can make and
    run: ``native`` (the session's build), then the narrower targets this CPU runs
    (``native_build.NARROWER``: AVX-512, AVX2 + FMA, SSE2 on x86-64; plain NEON on
    aarch64), so the vector widths and instruction choices other hosts get are tested here
    too. A target whose build reports the same ISA as one tested already (x86-64-v4 on an
    AVX-512 host) is skipped, as is one this compiler cannot build. Module-scoped: pytest
    groups a module's tests per build, one switch each; each build takes ~2 s, once."""
    from ling3_rknn.model import native

    march = request.param
    if march == "native":
        yield march
        return
    directory = Path(os.environ[native_build.KERNEL_DIR_ENV]).with_name(f"kernels-{march}")
    if march not in native_build.marches_here():
        pytest.skip(f"this CPU does not run -march={march}")
    if march not in _KERNEL_ISAS:
        try:
            _KERNEL_ISAS[march] = _built(directory, march)
        except native_build.BuildError as exc:
            _KERNEL_ISAS[march] = ""
            sys.stderr.write(f"conftest.py: no -march={march} kernels: {exc}\n")
    isa = _KERNEL_ISAS[march]
    if not isa:
        pytest.skip(f"-march={march} does not build here")
    native_isa = native_build.Manifest.read(
        native_build.kernel_directory() / native_build.MANIFEST).isa
    earlier = [m for m in _KERNEL_ISAS if m != march and _KERNEL_ISAS[m] == isa]
    if isa == native_isa or any(native_build.marches_here().index(m)
                                < native_build.marches_here().index(march) for m in earlier):
        pytest.skip(f"-march={march} builds the same ISA as a wider target ({isa})")
    status = native.use_library(directory)
    try:
        assert native.available(), status
        yield march
    finally:
        native.use_library(None)


FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Tiny random Ling-3.0 checkpoints + transformers 5.24.0 reference logits
# (regenerate with tests/oracle/make_fixtures.py).
ORACLE_DIR = FIXTURES / "oracle"
ORACLE_FIXTURES = ("lora_hfsave", "plainq_released", "lora_hfmodule_bf16")
# The widths the compiled kernels take (16 heads, KDA head dim 16): the model oracle only
# (the converter's tests gain nothing from a fourth spelling of the same files).
KERNEL_WIDTHS_FIXTURE = "kernel_widths"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """An HF-style checkpoint directory of a tiny random Ling-3.0 model (vocab 256)."""
    return ORACLE_DIR / ORACLE_FIXTURES[0]


@pytest.fixture(autouse=True, scope="session")
def roomy_machine():
    """Serving sizes its prefix cache and prefill scratch from the memory the machine has
    free (``ling3_rknn.memory_plan``): in-process engines see a roomy machine here, so a
    test's cache does not depend on what the runner has free (test_memory_plan.py tests
    the plan itself). Session-scoped so module-scoped engines are built under it too."""
    from ling3_rknn import loading

    roomy = {"MemTotal": 64 << 30, "MemAvailable": 64 << 30}
    patch = pytest.MonkeyPatch()
    patch.setattr(loading, "machine_memory", lambda: dict(roomy))
    yield
    patch.undo()

"""Building the decode kernels for the machine that installs the package.

``ling3-rknn build-kernels`` (run by ``make venv`` and by the board guide's install step,
after ``pip install``) compiles the kernels' C files (``SOURCES``) with the machine's C
compiler into ``ling3-native.so`` in the install's kernel directory, next to a manifest
(``ling3-native.json``) saying what it was built from and for. The service (``native.py``)
only loads that pair and checks the manifest; it never runs a compiler, so a hardened unit
neither needs gcc nor writes and loads code of its own.

Why an explicit step and not a setuptools extension: a wheel is built once and installed
elsewhere (PyPI; the aarch64 tier builds it on x86), and ``-march=native`` must see the
CPU that will run the code: the host's AVX-512 or AVX2, the RK3588's A76 with fp16 and
dot products. Why ctypes and not a CPython extension: the kernels need no Python API, so
no Python headers on the board, and ctypes releases the GIL during a call.

Where: ``$LING3_RKNN_KERNEL_DIR``, else ``<sys.prefix>/lib/ling3-rknn`` (the venv's own:
``/opt/ling3-rknn/.venv/lib/ling3-rknn`` on the board), written by whoever installed the
venv and only read by the service (``ReadOnlyPaths=/opt/ling3-rknn``), so files are made
world-readable whatever the umask.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ling3_rknn.npu import matmul_standin_build
from ling3_rknn.paths import KERNEL_DIR_ENV, kernel_directory

from .native_abi import HEADER, abi

SOURCE_DIR = Path(__file__).parent
SOURCES = ("mla_attention.c", "kda_decode.c", "kda_chunk.c", "attn_softmax.c", "moe_int8.c",
           "native_info.c")
HEADERS = ("native_vec.h", HEADER.name)
LIBRARY = "ling3-native.so"
MANIFEST = "ling3-native.json"
BUILD_TIMEOUT_S = 300
_COMMON_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-shared")


class BuildError(RuntimeError):
    """The kernels could not be built; the message says why (the compiler's own words)."""


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``, if it is on PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


# Narrower targets ``build-kernels --march`` takes besides ``native``, widest first, with the
# /proc/cpuinfo flags a CPU needs to run code built for them. On x86-64 they are the psABI
# levels (v4: AVX-512, 16 floats a vector; v3: AVX2 + FMA + F16C, 8; the baseline: SSE2, 4,
# no F16C so a float16 cache stays on numpy); on aarch64 the plain ARMv8-A (NEON, 4 floats,
# no fp16 arithmetic or dot products). They let one wide machine build and test every vector
# width the kernels have (tests/conftest.py); the service wants ``native``.
MARCH_ENV = "LING3_RKNN_KERNEL_MARCH"
_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
NARROWER: dict[str, dict[str, frozenset[str]]] = {
    "x86_64": {"x86-64-v4": frozenset(_V4), "x86-64-v3": frozenset(_V3),
               "x86-64": frozenset()},
    "aarch64": {"armv8-a": frozenset()},
}


def _machine_family(machine: str | None = None) -> str:
    machine = machine or platform.machine()
    return {"AMD64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def machine_flags(machine: str | None = None, march: str = "native") -> tuple[str, ...]:
    """The target flags for this machine. ``-march=native`` everywhere, as llama.cpp builds
    by default: on x86-64 the host's AVX-512 or AVX2 (+F16C for the float16 cache), on
    aarch64 what gcc reads from an RK3588's cpuinfo, ``armv8.2-a+crypto+fp16+rcpc+dotprod``
    (the aarch64 tier checks the kernels built so; ``-mcpu`` would add A76 tuning, which
    nobody has measured on the board). ``march`` names one of ``NARROWER`` instead (raises
    BuildError for another name)."""
    family = _machine_family(machine)
    if march != "native":
        if march not in NARROWER.get(family, {}):
            known = ", ".join(["native", *NARROWER.get(family, {})])
            raise BuildError(f"-march={march} is not a target for {family} (one of: {known})")
        return (f"-march={march}",)
    if family in NARROWER:
        return ("-march=native",)
    return ()  # another machine: the compiler's defaults, still correct


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def runs_here(march: str) -> bool:
    """Whether this CPU runs code built with ``-march=march`` (``native`` always does)."""
    if march == "native":
        return True
    needs = NARROWER.get(_machine_family(), {}).get(march)
    return needs is not None and needs <= _cpu_flags()


def marches_here() -> tuple[str, ...]:
    """``native`` and the narrower targets this CPU runs, widest first: the kernel paths a
    test session can build and run on this machine (some may name the same code, e.g.
    ``x86-64-v4`` on an AVX-512 host; the builder's ISA string tells them apart)."""
    return ("native", *(m for m in NARROWER.get(_machine_family(), {}) if runs_here(m)))


def cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags, as one digest."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    keep = ("model name", "flags", "Features", "CPU part", "CPU implementer")
    text = "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))
    return hashlib.sha256(f"{platform.machine()}\n{text}".encode()).hexdigest()[:16]


def sources_digest(source_dir: Path = SOURCE_DIR) -> str:
    """A digest of the C sources and headers: a library built from other sources (an
    upgrade since the last build) is refused by the loader."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (source_dir / name).read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Manifest:
    """What ``ling3-native.json`` records beside the library."""

    abi: int
    sources: str  # sources_digest()
    cpu: str  # cpu_identity()
    machine: str
    isa: str  # the library's ling3_native_isa()
    compiler: str
    flags: list[str]
    built: str  # UTC, ISO 8601

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Raises OSError, ValueError (not JSON) or TypeError (other fields)."""
        return cls(**json.loads(path.read_text()))

    def mismatch(self) -> str | None:
        """Why this build must not run here, or None: other sources, another CPU."""
        if self.sources != sources_digest():
            return "built from other sources (the package changed since `build-kernels`)"
        if self.cpu != cpu_identity():
            return f"built for another CPU ({self.machine}, {self.isa})"
        return None


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return cc
    return out.stdout.splitlines()[0] if out.stdout.strip() else cc


def _probe_isa(library: Path) -> str:
    """The ISA string of a freshly built library, read in a child process, so the builder
    never maps a library into itself (a test session may hold another one)."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "lib.ling3_native_isa.restype = ctypes.c_char_p; "
            "print(lib.ling3_native_abi()); print(lib.ling3_native_isa().decode())")
    out = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True,
                         text=True, timeout=60)
    lines = out.stdout.split("\n")
    if out.returncode != 0 or len(lines) < 2:
        raise BuildError(f"the built library does not load: {out.stderr.strip()[-500:]}")
    if int(lines[0]) != abi().version:
        raise BuildError(f"the built library reports ABI {lines[0]}, the header "
                         f"{abi().version}")
    return lines[1].strip()


def _write_readable(directory: Path, name: str, write: str | Path) -> None:
    """Put ``name`` into ``directory`` whole or not at all, mode 0644 (the service's user
    reads what root installed): from a text or by moving a finished file."""
    fd, tmp = tempfile.mkstemp(prefix=name, suffix=".tmp", dir=directory)
    try:
        if isinstance(write, Path):
            os.close(fd)
            os.replace(write, tmp)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(write)
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(directory: Path | None = None, cc: str | None = None,
          source_dir: Path = SOURCE_DIR, march: str | None = None) -> Manifest:
    """Compile the kernels for this machine into ``directory`` (default
    ``kernel_directory()``) and write their manifest, then the NPU matmul stand-in
    (``npu/matmul_standin_build.py``). Concurrent builds each compile into
    their own temporary file; the library and then its manifest replace the old ones
    atomically. ``march`` (default ``$LING3_RKNN_KERNEL_MARCH``, else ``native``) may name
    a narrower target this CPU runs (``NARROWER``). Raises BuildError with the compiler's
    message, or for a target that is unknown or that this CPU cannot run."""
    directory = directory or kernel_directory()
    march = march or os.environ.get(MARCH_ENV) or "native"
    target = machine_flags(march=march)
    if not runs_here(march):
        raise BuildError(f"this CPU cannot run code built with -march={march}")
    cc = cc or compiler()
    if cc is None:
        raise BuildError("no C compiler (cc or $CC) on PATH")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if directory.stat().st_uid == os.getuid():  # made under a strict umask: open it
            os.chmod(directory, directory.stat().st_mode | 0o755)
        return _build_into(directory, cc, source_dir, target)
    except PermissionError as exc:
        raise BuildError(f"cannot write {directory}: {exc} (run as the user that installed "
                         f"the venv, or set ${KERNEL_DIR_ENV})") from exc
    except OSError as exc:
        raise BuildError(f"cannot build into {directory}: {exc}") from exc


def _build_into(directory: Path, cc: str, source_dir: Path, target: tuple[str, ...]
                ) -> Manifest:
    flags = [*_COMMON_FLAGS, *target]
    with tempfile.TemporaryDirectory(prefix="ling3-native-", dir=directory) as work:
        built = Path(work) / LIBRARY
        command = [cc, *flags, "-o", str(built), *(str(source_dir / s) for s in SOURCES), "-lm"]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        except subprocess.CalledProcessError as exc:
            raise BuildError(f"{cc} failed: {exc.stderr.strip()[-1500:]}") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildError(f"{cc} did not run: {exc}") from exc
        manifest = Manifest(
            abi=abi().version, sources=sources_digest(source_dir), cpu=cpu_identity(),
            machine=platform.machine(), isa=_probe_isa(built), compiler=_compiler_version(cc),
            flags=flags, built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        _write_readable(directory, LIBRARY, built)
    _write_readable(directory, MANIFEST, json.dumps(asdict(manifest), indent=1) + "\n")
    try:  # the NPU matmul stand-in, for LING3_NPU_RUNTIME=mock (docs/npu-matmul.md)
        matmul_standin_build.build(directory, cc, machine_flags())
    except matmul_standin_build.StandinBuildError as exc:
        raise BuildError(f"the NPU matmul stand-in: {exc}") from exc
    return manifest

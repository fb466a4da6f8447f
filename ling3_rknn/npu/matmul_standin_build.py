"""Building and finding the host stand-in for librknnrt's matmul API.

``ling3-rknn build-kernels`` (``model/native_build.py``) compiles ``matmul_standin.c``
into the install's kernel directory beside the decode kernels, with a small manifest of
the sources it was built from; ``LING3_NPU_RUNTIME=mock`` (and ``auto`` off a board) loads
it through the same binding as the board's ``/usr/lib/librknnrt.so``. Built with the
kernels' target flags (``-march=native``: twice the speed of the baseline target for the
tests that run attention and experts through it); like the kernels, it belongs to the
machine that built it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from ling3_rknn.npu.matmul_plan import MatmulError
from ling3_rknn.paths import kernel_directory

SOURCE_DIR = Path(__file__).parent
SOURCES = ("matmul_standin.c",)
HEADERS = ("rknn_matmul_abi.h",)
LIBRARY = "ling3-rknnrt-standin.so"
MANIFEST = "ling3-rknnrt-standin.json"
FLAGS = ("-O3", "-fPIC", "-shared", "-pthread")  # plus the caller's target flags
BUILD_TIMEOUT_S = 300


class StandinBuildError(RuntimeError):
    """The stand-in could not be compiled; the message carries the compiler's words."""


def sources_digest(source_dir: Path = SOURCE_DIR) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (source_dir / name).read_bytes())
    return digest.hexdigest()[:16]


def _replace_readable(src: Path, dst: Path) -> None:
    os.chmod(src, 0o644)
    os.replace(src, dst)


def build(directory: Path, cc: str, target_flags: tuple[str, ...] = (),
          source_dir: Path = SOURCE_DIR) -> Path:
    """Compile the stand-in into ``directory`` (which exists); the library, then its
    manifest, replace the old ones atomically. Returns the library's path."""
    flags = [*FLAGS, *target_flags]
    with tempfile.TemporaryDirectory(prefix="ling3-standin-", dir=directory) as work:
        built = Path(work) / LIBRARY
        command = [cc, *flags, f"-I{source_dir}", "-o", str(built),
                   *(str(source_dir / s) for s in SOURCES)]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        except subprocess.CalledProcessError as exc:
            raise StandinBuildError(f"{cc} failed: {exc.stderr.strip()[-1500:]}") from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StandinBuildError(f"{cc} did not run: {exc}") from exc
        manifest = Path(work) / MANIFEST
        manifest.write_text(json.dumps({"sources": sources_digest(source_dir),
                                        "flags": flags}) + "\n")
        _replace_readable(built, directory / LIBRARY)
        _replace_readable(manifest, directory / MANIFEST)
    return directory / LIBRARY


def library_path(directory: Path | None = None) -> Path:
    """The built stand-in, checked against the sources this package carries; raises
    ``MatmulError`` saying how to build it when it is missing or stale."""
    directory = directory or kernel_directory()
    library = directory / LIBRARY
    fix = "run `ling3-rknn build-kernels` (it needs a C compiler)"
    try:
        recorded = json.loads((directory / MANIFEST).read_text())["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        raise MatmulError(f"the NPU matmul stand-in is not built in {directory}: {fix}"
                          ) from None
    if recorded != sources_digest() or not library.is_file():
        raise MatmulError(f"the NPU matmul stand-in in {directory} was built from other "
                          f"sources: {fix}")
    return library

"""The decode kernels are built at install (``ling3-rknn build-kernels``,
``native_build.py``) and only loaded by the runtime (``native.py``), which checks what it
loads and says which glue runs; their ABI is declared once, in ``native_abi.h``."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ling3_rknn import cli
from ling3_rknn.doctor import host
from ling3_rknn.model import native, native_abi, native_build
from ling3_rknn.npu import matmul_standin_build

needs_cc = pytest.mark.skipif(native_build.compiler() is None,
                              reason="no C compiler on this machine")
needs_session_build = pytest.mark.skipif(
    not native.library_path().is_file(),
    reason="conftest.py built no kernels for this session (no C compiler)")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """native's loader as at process start, looking in an empty kernel directory."""
    kernels = tmp_path / "kernels"
    monkeypatch.setenv(native_build.KERNEL_DIR_ENV, str(kernels))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_status", "not loaded yet")
    return kernels


@pytest.fixture
def installed(fresh_loader):
    """The session's build (conftest.py), copied into the fresh kernel directory."""
    session = Path(os.environ["LING3_RKNN_STATE_DIR"]) / "kernels"
    if not (session / native_build.LIBRARY).is_file():
        pytest.skip("conftest.py built no kernels for this session (no C compiler)")
    shutil.copytree(session, fresh_loader)
    return fresh_loader


def _no_compiler_at_load(monkeypatch):
    """Loading must never compile: any attempt fails the test."""
    monkeypatch.setattr(native_build, "build", lambda *a, **k: pytest.fail("built at load"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a program"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("ran a program"))


def _edit_manifest(directory: Path, **changes) -> None:
    path = directory / native_build.MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# --- the install step ------------------------------------------------------------------


@needs_cc
def test_build_writes_a_readable_library_and_its_manifest(tmp_path, monkeypatch):
    monkeypatch.delenv(native_build.MARCH_ENV, raising=False)
    old = os.umask(0o077)  # as under the unit's UMask: the service's user must still read
    try:
        manifest = native_build.build(tmp_path / "k")
    finally:
        os.umask(old)
    files = sorted(p.name for p in (tmp_path / "k").iterdir())
    # no temporary left; the NPU matmul stand-in beside the kernels (test_npu_matmul.py)
    assert files == sorted([native_build.MANIFEST, native_build.LIBRARY,
                            matmul_standin_build.MANIFEST, matmul_standin_build.LIBRARY])
    for name in files:
        assert (tmp_path / "k" / name).stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "k").stat().st_mode & 0o755 == 0o755
    assert manifest.abi == native.ABI and manifest.sources == native_build.sources_digest()
    assert manifest.cpu == native_build.cpu_identity()
    assert manifest.isa.split()[0] in ("x86_64", "aarch64", "other")
    assert "-march=native" in manifest.flags or not native_build.machine_flags()
    assert native_build.Manifest.read(tmp_path / "k" / native_build.MANIFEST) == manifest


def test_a_narrower_target_is_built_when_asked_and_refused_when_unknown(tmp_path, monkeypatch,
                                                                       capsys):
    """One machine builds each vector width it runs (tests/conftest.py ``kernel_march``):
    the target is passed to the compiler and recorded; an unknown one, or one for another
    machine, is refused before anything is compiled."""
    assert native_build.machine_flags("x86_64", "x86-64-v3") == ("-march=x86-64-v3",)
    assert native_build.machine_flags("aarch64", "armv8-a") == ("-march=armv8-a",)
    with pytest.raises(native_build.BuildError, match="not a target for aarch64"):
        native_build.machine_flags("aarch64", "x86-64-v3")
    assert native_build.marches_here()[0] == "native"
    assert all(native_build.runs_here(m) for m in native_build.marches_here())
    monkeypatch.setattr(native_build, "compiler", lambda: pytest.fail("compiled"))
    assert cli.main(["build-kernels", "--dir", str(tmp_path / "k"), "--march", "pentium"]) == 1
    assert "-march=pentium is not a target" in capsys.readouterr().err
    monkeypatch.setenv(native_build.MARCH_ENV, "pentium")
    with pytest.raises(native_build.BuildError, match="pentium"):
        native_build.build(tmp_path / "k")
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: set())  # a CPU without AVX2
    if "x86-64-v3" in native_build.NARROWER.get(native_build._machine_family(), {}):
        assert not native_build.runs_here("x86-64-v3")
        with pytest.raises(native_build.BuildError, match="cannot run"):
            native_build.build(tmp_path / "k", march="x86-64-v3")


@needs_cc
def test_a_narrower_build_records_its_target(tmp_path):
    march = native_build.marches_here()[-1]  # the narrowest this CPU runs
    manifest = native_build.build(tmp_path / "k", march=march)
    assert manifest.flags[-1] == f"-march={march}" or march == "native"
    assert native.use_library(tmp_path / "k").startswith(f"compiled ({tmp_path / 'k'}")
    assert native.available()
    native.use_library(None)
    assert native.status().startswith(f"compiled ({native.library_path()}; ")


def test_a_failing_compiler_is_reported_and_leaves_nothing(tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'mla_attention.c:1: error: no' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(native_build.BuildError, match="error: no"):
        native_build.build(tmp_path / "k", cc=str(fake))
    assert not any((tmp_path / "k").iterdir())


def test_without_a_compiler_the_build_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert cli.main(["build-kernels", "--dir", str(tmp_path / "k")]) == 1
    err = capsys.readouterr().err
    assert "no C compiler" in err and "apt install gcc" in err and "numpy" in err


@needs_cc
def test_build_kernels_command_builds_where_the_loader_looks(fresh_loader, capsys):
    assert cli.main(["build-kernels"]) == 0
    assert str(fresh_loader / native_build.LIBRARY) in capsys.readouterr().out
    assert native.available(), native.status()


def test_the_default_directory_is_the_installs_own(monkeypatch):
    monkeypatch.delenv(native_build.KERNEL_DIR_ENV)
    assert native_build.kernel_directory() == Path(sys.prefix) / "lib" / "ling3-rknn"


def test_the_sources_digest_follows_every_source(monkeypatch, tmp_path):
    first = native_build.sources_digest()
    for name in (*native_build.SOURCES, *native_build.HEADERS):
        (tmp_path / name).write_bytes((native_build.SOURCE_DIR / name).read_bytes())
    assert native_build.sources_digest(tmp_path) == first
    for name in (*native_build.SOURCES, *native_build.HEADERS):
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(original + b"\n")
        assert native_build.sources_digest(tmp_path) != first, name
        (tmp_path / name).write_bytes(original)


# --- the runtime only loads --------------------------------------------------------------


def test_loads_the_installed_library_and_logs_which_glue_runs(installed, monkeypatch,
                                                              caplog):
    _no_compiler_at_load(monkeypatch)
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.available(), native.status()
    manifest = native_build.Manifest.read(installed / native_build.MANIFEST)
    assert native.status().startswith(f"compiled ({installed / native_build.LIBRARY}; "
                                      f"{manifest.isa}; ")
    assert f"decode glue: compiled ({installed}" in caplog.text


def test_not_built_stays_on_numpy_without_compiling(fresh_loader, monkeypatch, caplog):
    _no_compiler_at_load(monkeypatch)
    assert not native.available()
    assert native.status() == (f"not built: no {native_build.LIBRARY} in {fresh_loader}: "
                               "decode glue on numpy")
    assert "decode glue on numpy" in caplog.text and "build-kernels" in caplog.text
    assert not fresh_loader.exists()


def test_switched_off_by_the_environment(installed, monkeypatch, caplog):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert not native.available()
    assert "LING3_RKNN_NATIVE=0" in native.status()
    assert "decode glue: numpy" in caplog.text


def test_a_build_from_other_sources_is_refused(installed, monkeypatch):
    _no_compiler_at_load(monkeypatch)
    _edit_manifest(installed, sources="0" * 16)
    assert not native.available()
    assert "built from other sources" in native.status()


def test_a_build_for_another_cpu_is_refused(installed, monkeypatch):
    _edit_manifest(installed, cpu="0" * 16, isa="aarch64 neon")
    assert not native.available()
    assert "built for another CPU" in native.status() and "aarch64 neon" in native.status()


def test_an_unreadable_manifest_is_reported(installed):
    (installed / native_build.MANIFEST).write_text("{")
    assert not native.available()
    assert "not readable" in native.status()


def test_a_library_that_does_not_load_is_reported(installed, caplog):
    (installed / native_build.LIBRARY).write_bytes(b"not a shared library")
    assert not native.available()
    assert "not usable" in native.status() and "not usable" in caplog.text


def test_a_library_of_another_abi_is_refused(installed, monkeypatch):
    class Stale:
        @staticmethod
        def ling3_native_abi() -> int:
            return native.ABI + 1

    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: Stale())
    assert not native.available()
    assert f"ABI {native.ABI + 1}, want {native.ABI}" in native.status()


def test_a_library_missing_a_declared_kernel_is_refused(installed, monkeypatch):
    class Partial:
        @staticmethod
        def ling3_native_abi() -> int:
            return native.ABI

    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: Partial())
    assert not native.available()
    assert "not usable" in native.status()


# --- doctor ------------------------------------------------------------------------------


def test_doctor_names_the_library_and_its_isa(installed):
    check = host.decode_kernels()
    assert check.status == "ok" and str(installed) in check.detail
    assert native_build.Manifest.read(installed / native_build.MANIFEST).isa in check.detail


def test_doctor_gives_the_build_command(fresh_loader, monkeypatch):
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    check = host.decode_kernels()
    assert check.status == "warn" and "not built" in check.detail
    assert "apt install gcc" in check.fix and "build-kernels" in check.fix
    monkeypatch.setattr(native_build, "compiler", lambda: "/usr/bin/cc")
    assert "apt install gcc" not in host.decode_kernels().fix


# --- the ABI, declared once ----------------------------------------------------------------


def test_the_header_declares_every_kernel_with_its_types():
    abi = native_abi.abi()
    assert set(abi.functions) == {"ling3_native_abi", "ling3_native_isa", "mla_decode_attend",
                                  "mla_prefill_attend", "kda_decode_heads", "kda_chunk_heads",
                                  "attn_softmax_piece", "half_rows", "moe_quantize_rows",
                                  "moe_swiglu_quantize", "moe_scatter_add"}
    assert abi.version == native.ABI
    kda = abi.functions["kda_decode_heads"]
    assert len(kda.params) == 20 and kda.restype is ctypes.c_int
    assert kda.params[0] == ("float *", "qkv") and kda.params[14] == ("float", "fold_below")
    assert kda.argtypes[14] is ctypes.c_float and kda.argtypes[0] is ctypes.c_void_p
    prefill = abi.functions["mla_prefill_attend"]
    assert prefill.params[6] == ("void **", "blocks")
    assert prefill.argtypes[9] is ctypes.c_int64 and prefill.argtypes[1] is ctypes.c_void_p
    assert abi.functions["ling3_native_isa"].restype is ctypes.c_char_p
    assert abi.functions["ling3_native_abi"].params == ()
    chunk = abi.functions["kda_chunk_heads"]
    assert chunk.params[5] == ("int", "t_len") and chunk.argtypes[9] is ctypes.c_void_p
    softmax = abi.functions["attn_softmax_piece"]
    assert softmax.params[3] == ("int32_t *", "limit") and softmax.argtypes[1] is ctypes.c_int
    assert abi.functions["moe_scatter_add"].params[6] == ("int64_t *", "rows")
    assert (native._LANES, native._MLA_GROUP, native._TILE_BLOCK) == (16, 64, 4)
    assert (native._KDA_SUB, native._KDA_MAX_CHUNK, native._KDA_D_MULTIPLE) == (16, 128, 16)


@pytest.mark.parametrize("text,error", [
    ("#define LING3_NATIVE_ABI 1\nint f(double x);", "double"),
    ("#define LING3_NATIVE_ABI 1\nstruct s { int a; };", "not a prototype"),
    ("int f(int x);", "LING3_NATIVE_ABI"),
])
def test_the_header_reader_refuses_what_it_cannot_bind(text, error):
    with pytest.raises(native_abi.AbiError, match=error):
        native_abi.parse(text)


@needs_cc
def test_the_compiler_holds_the_c_to_the_header(tmp_path):
    """A kernel defined differently from its prototype does not build."""
    for name in (*native_build.SOURCES, *native_build.HEADERS):
        shutil.copy(native_build.SOURCE_DIR / name, tmp_path / name)
    header = tmp_path / native_abi.HEADER.name
    header.write_text(header.read_text().replace("int kda_decode_heads(const float *qkv,",
                                                 "int kda_decode_heads(const double *qkv,"))
    with pytest.raises(native_build.BuildError, match="conflicting types"):
        native_build.build(tmp_path / "k", source_dir=tmp_path)


@needs_session_build
def test_the_library_reports_the_headers_abi_and_an_isa():
    lib = ctypes.CDLL(str(native.library_path()))
    native_abi.abi().bind(lib)
    assert lib.ling3_native_abi() == native.ABI
    assert lib.ling3_native_isa().decode().split()[0] in ("x86_64", "aarch64", "other")

"""The board install resolves: every runtime dependency plus the ``board`` extra has a wheel
for aarch64 Linux and the board's Python, so ``pip install 'ling3-rknn[board]'`` on the
CM3588 never falls back to compiling from source.

pip resolves the set for the target platform without installing anything (``--dry-run``
with ``--report``; the registry's metadata files spare downloading whole wheels). The
dependency list is read from pyproject.toml, so a dependency added later is checked too.
Environment markers are dropped on purpose: pip evaluates them for the machine it runs
on (x86_64 here), which would hide the aarch64-only ``rknn-toolkit-lite2``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Debian 12 (the FriendlyElec CM3588 image) ships Python 3.11, Ubuntu 24.04 3.12. Ubuntu 22.04's
# 3.10 is out: onnxruntime has no cp310 wheel since 1.24 (this test found it). The
# aarch64 onnxruntime wheels since 1.17 are manylinux_2_28 (glibc >= 2.28: both qualify).
BOARD_PYTHONS = ("3.11", "3.12")
PLATFORMS = ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64")
_OFFLINE = re.compile(r"NewConnectionError|Temporary failure in name resolution|"
                      r"Network is unreachable|ConnectTimeout")


@functools.cache
def index_unreachable() -> str | None:
    """Why the package index pip would ask cannot be reached, or None when it answers.

    Asked once, with a short timeout, before pip runs: offline, pip itself would retry each
    request for minutes (``PIP_DEFAULT_TIMEOUT``) before failing."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/pip/", timeout=10):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as e:
        return f"the package index {index} is not reachable ({e}): this test needs the network"


def board_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"]["board"]]
    return [r.split(";")[0].strip() for r in reqs]


def test_board_extra_lists_the_npu_runtime():
    assert any(r.startswith("rknn-toolkit-lite2") for r in board_requirements())


@pytest.mark.network
@pytest.mark.parametrize("python", BOARD_PYTHONS)
def test_board_install_resolves_to_aarch64_wheels(tmp_path, python):
    if (why := index_unreachable()) is not None:
        pytest.skip(why)
    report = tmp_path / "report.json"
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    abi = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--only-binary=:all:", *platforms, "--python-version", python,
           "--implementation", "cp", "--abi", abi, "--target", str(tmp_path / "t"),
           "--report", str(report), "--quiet", "--disable-pip-version-check",
           *board_requirements()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        if _OFFLINE.search(done.stderr):
            pytest.skip("the package index stopped answering while pip resolved: this test "
                        "needs the network")
        missing = re.findall(r"(?:No matching distribution found for|satisfies the "
                             r"requirement) ([A-Za-z0-9_.\-\[\]]+)", done.stderr)
        pytest.fail(f"no aarch64 wheel for Python {python}: "
                    f"{', '.join(sorted(set(missing))) or done.stderr[-2000:]}")
    installs = json.loads(report.read_text())["install"]
    wheels = {i["metadata"]["name"]: i["download_info"]["url"].rsplit("/", 1)[-1]
              for i in installs}
    assert "onnxruntime" in wheels and "rknn-toolkit-lite2" in wheels
    wrong = {name: wheel for name, wheel in wheels.items()
             if not wheel.endswith(".whl")
             or not (wheel.endswith("-any.whl") or "aarch64" in wheel)}
    assert not wrong, f"not aarch64 (or pure Python) wheels: {wrong}"

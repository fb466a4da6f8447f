"""The shipped systemd unit passes ``systemd-analyze verify``.

verify also checks that every ``Exec*=`` program exists and is executable; on a host the
install path (/opt/ling3-rknn/.venv/bin/...) does not, so the copy under test points those
programs at a stub in tmp_path and keeps every other line as shipped. A unit with a line
systemd cannot parse must fail here (the broken-copy test proves the check can fail).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "ling3-rknn.service"
ENV_FILE = UNIT.with_name("ling3-rknn.env")
INSTALL_PREFIX = "/opt/ling3-rknn/"

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                 reason="systemd-analyze not installed (make system-tools)")]


def verify(text: str, tmp_path: Path) -> tuple[int, str]:
    stub = tmp_path / "bin" / "ling3-rknn"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    text = re.sub(r"(?m)^(Exec\w*=[-@:+!]*)" + re.escape(INSTALL_PREFIX) + r"\S+",
                  lambda m: m.group(1) + str(stub), text)
    unit = tmp_path / "ling3-rknn.service"
    unit.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)
    # verify exits 0 on lines it ignores; those warnings name the unit file
    return done.returncode, "\n".join(line for line in done.stderr.splitlines()
                                      if "ling3-rknn.service" in line)


def test_shipped_unit_verifies(tmp_path):
    text = UNIT.read_text()
    assert INSTALL_PREFIX in text
    rc, complaints = verify(text, tmp_path)
    assert rc == 0 and not complaints, complaints


def test_a_broken_unit_is_caught(tmp_path):
    text = UNIT.read_text()
    assert "Type=notify" in text  # the server sends READY=1 (ling3_rknn/server/sd_notify.py)
    rc, complaints = verify(text.replace("Type=notify", "Type=sometimes"), tmp_path)
    assert rc != 0 or "Type" in complaints or "service type" in complaints


def test_every_variable_the_unit_uses_is_set_by_the_env_file():
    """systemd expands an unset ${VAR} to nothing, which would shift serve's arguments."""
    used = set(re.findall(r"\$\{(\w+)\}", UNIT.read_text()))
    defined = {line.split("=", 1)[0] for line in ENV_FILE.read_text().splitlines()
               if line and not line.startswith("#")}
    assert used and used <= defined, used - defined

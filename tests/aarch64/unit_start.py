"""Start the shipped systemd unit's commands the way systemd would, on the emulated board,
up to ``/health`` answering 200, then stop it as systemd does.

There is no systemd inside a chroot, so this does its part from the unit file itself:
the user and groups of ``User=``/``Group=``/``SupplementaryGroups=``, the variables of
``EnvironmentFile=`` (and only those, plus what systemd sets: PATH, HOME, USER,
STATE_DIRECTORY, NOTIFY_SOCKET), ``StateDirectory=`` created with its mode and owner,
``WorkingDirectory=``, ``UMask=``, ``${VAR}`` expanded in ``ExecStartPre=`` and
``ExecStart=`` as one word each, a ``-`` prefix ignoring the exit status, ``Type=notify``'s
READY=1 and ``KillSignal=``. The sandboxing lines (ProtectSystem=, DevicePolicy=, ...) are
not applied; ``systemd-analyze verify`` checks them on the host (tests/test_systemd_unit.py).

Setup follows docs/board-guide.md section 5; what differs for emulation: the bundle is the
package's demo bundle copied to the env file's path, the port is a free one, and
LING3_NPU_RUNTIME=mock (no NPU under qemu: the RKNNLite mock on onnxruntime).
"""

from __future__ import annotations

import configparser
import contextlib
import grp
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ling3_rknn.demo import bundle_dir

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
START_TIMEOUT_S = 1800  # the unit allows 600 on a board; emulated, a load is much slower


def read_unit(path: Path) -> dict[str, list[str]]:
    """[Service] keys to their values, repeated keys kept in order, ``\\`` continuations
    joined."""
    service: dict[str, list[str]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            service.setdefault(key.strip(), []).append(value.strip())
    return service


def read_env_file(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keep the variables' case
    parser.read_string("[env]\n" + path.read_text())
    return dict(parser["env"])


def expand(command: str, env: dict[str, str]) -> tuple[bool, list[str]]:
    """(ignore failure, argv): systemd's ``${VAR}`` is one word, its ``-`` prefix a flag."""
    ignore = command.startswith("-")
    words = shlex.split(command.lstrip("-@:+!"))
    return ignore, [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in words]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install(unit: dict[str, list[str]], env_src: Path) -> tuple[Path, dict[str, str]]:
    """The board guide's section 5 (and its bundle copy from section 2) on this root."""
    user, home = unit["User"][0], unit["WorkingDirectory"][0]
    for group in unit.get("SupplementaryGroups", [""])[0].split():
        try:
            grp.getgrnam(group)
        except KeyError:  # udev creates render on a real board; a chroot has no udev
            subprocess.run(["groupadd", "--system", group], check=True)
    try:
        pwd.getpwnam(user)
    except KeyError:
        groups = ",".join(unit.get("SupplementaryGroups", [""])[0].split())
        subprocess.run(["useradd", "--system", "--home", home, "--groups", groups, user],
                       check=True)
    env_path = Path(unit["EnvironmentFile"][0].lstrip("-"))
    values = read_env_file(env_src)
    shutil.copytree(bundle_dir(), values["LING3_RKNN_BUNDLE"], dirs_exist_ok=True)
    text = env_src.read_text()
    text = re.sub(r"(?m)^LING3_RKNN_PORT=.*$", f"LING3_RKNN_PORT={free_port()}", text)
    text += "# emulation has no NPU: the stage graphs run on the RKNNLite mock\n"
    text += "LING3_NPU_RUNTIME=mock\n"
    env_path.parent.mkdir(parents=True, exist_ok=True)
    env_path.write_text(text)
    env_path.chmod(0o600)
    state = Path("/var/lib") / unit["StateDirectory"][0]
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(int(unit.get("StateDirectoryMode", ["0755"])[0], 8))
    account = pwd.getpwnam(user)
    os.chown(state, account.pw_uid, grp.getgrnam(unit["Group"][0]).gr_gid)
    return state, read_env_file(env_path)


def wait_ready(notify: socket.socket, base: str, server: subprocess.Popen) -> list[str]:
    """Until READY=1 arrived and /health answered 200; the notify messages seen."""
    messages: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    notify.settimeout(1.0)
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"ExecStart exited with {server.returncode} before it was ready")
        with contextlib.suppress(TimeoutError):
            messages.append(notify.recv(4096).decode())
        if any("READY=1" in m for m in messages):
            with urllib.request.urlopen(base + "/health", timeout=10) as response:
                if response.status == 200:
                    return messages
        time.sleep(0.5)
    raise SystemExit(f"not ready after {START_TIMEOUT_S} s; notify messages: {messages}")


def main() -> int:
    unit_path, env_src = Path(sys.argv[1]), Path(sys.argv[2])
    unit = read_unit(unit_path)
    assert unit["Type"] == ["notify"], unit["Type"]
    state, file_env = install(unit, env_src)
    account = pwd.getpwnam(unit["User"][0])
    runtime = Path(tempfile.mkdtemp(prefix="ling3-notify-"))
    runtime.chmod(0o755)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(runtime / "notify"))
    (runtime / "notify").chmod(0o777)
    env = {"PATH": SYSTEMD_PATH, "HOME": account.pw_dir, "USER": account.pw_name,
           "LOGNAME": account.pw_name, "STATE_DIRECTORY": str(state),
           "NOTIFY_SOCKET": str(runtime / "notify"), **file_env}
    if "QEMU_CPU" in os.environ:  # the emulator's CPU model, not the service's setting
        env["QEMU_CPU"] = os.environ["QEMU_CPU"]
    as_service = {"user": account.pw_uid, "group": grp.getgrnam(unit["Group"][0]).gr_gid,
                  "extra_groups": [grp.getgrnam(g).gr_gid
                                   for g in unit.get("SupplementaryGroups", [""])[0].split()],
                  "umask": int(unit.get("UMask", ["0022"])[0], 8),
                  "cwd": unit["WorkingDirectory"][0], "env": env}
    for command in unit.get("ExecStartPre", []):
        ignore, argv = expand(command, env)
        done = subprocess.run(argv, **as_service, timeout=START_TIMEOUT_S)
        print(f"ExecStartPre exited {done.returncode}{' (ignored: -)' if ignore else ''}")
        if done.returncode and not ignore:
            return 1
    (command,) = unit["ExecStart"]
    _, argv = expand(command, env)
    print("ExecStart:", shlex.join(argv))
    base = f"http://{file_env['LING3_RKNN_HOST']}:{file_env['LING3_RKNN_PORT']}"
    started = time.monotonic()
    journal_path = Path(tempfile.mkdtemp(prefix="ling3-journal-")) / "stderr"
    journal = journal_path.open("w")  # the service's log, as the journal would keep it
    server = subprocess.Popen(argv, **as_service, stderr=journal)
    try:
        messages = wait_ready(notify, base, server)
        uid = next(line.split()[1] for line in
                   Path(f"/proc/{server.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))
        assert int(uid) == account.pw_uid, f"runs as uid {uid}, not {account.pw_name}"
        print(f"READY=1 and /health 200 after {time.monotonic() - started:.0f} s, "
              f"as {account.pw_name}")
        server.send_signal(getattr(signal, unit.get("KillSignal", ["SIGTERM"])[0]))
        code = server.wait(timeout=int(unit.get("TimeoutStopSec", ["90"])[0]))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    try:
        while True:
            messages.append(notify.recv(4096).decode())
    except (TimeoutError, BlockingIOError):
        pass
    notify.close()
    shutil.rmtree(runtime)
    journal.close()
    log = journal_path.read_text()
    shutil.rmtree(journal_path.parent)
    sys.stdout.write(log[-4000:])
    # The kernels board.sh installed (build-kernels), loaded and named in the log; the
    # service itself compiled nothing into its state directory.
    installed = Path(argv[0]).parent.parent / "lib" / "ling3-rknn" / "ling3-native.so"
    glue = [line for line in log.splitlines() if "decode glue" in line]
    built = sorted(str(p) for p in state.rglob("*.so"))
    owner = {pwd.getpwuid(p.stat().st_uid).pw_name for p in state.rglob("*")}
    print(f"stopped with exit status {code}; notify: {messages}")
    print(f"state directory {state}: written by {sorted(owner)}, libraries {built}")
    assert code == 0, f"SIGTERM ended the service with {code}"
    assert any("STOPPING=1" in m for m in messages), messages
    assert any(f"decode glue: compiled ({installed};" in line for line in glue), glue
    assert not built and owner <= {account.pw_name}, (built, owner)
    return 0


if __name__ == "__main__":
    sys.exit(main())

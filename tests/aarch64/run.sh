#!/usr/bin/env bash
# The aarch64 tier (docs/board-guide.md, "Before a board: the aarch64 tier"): the board's
# software stack on a Debian 12 arm64 root filesystem under qemu-user, Cortex-A76 model.
#
# Host side, as root (chroot, mounts, binfmt_misc): installs the emulation tools where
# missing, registers qemu-aarch64 with binfmt_misc, builds or reuses the cached root
# filesystem (tests/aarch64/rootfs.sh), records the x86 answers of the demo bundle, then
# runs tests/aarch64/board.sh inside the root filesystem.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
here="$repo/tests/aarch64"
venv="${VENV:-$repo/.venv}"
started=$SECONDS

if [ "$(id -u)" != 0 ]; then
    echo "the aarch64 tier needs root (chroot, mount, binfmt_misc): run it with sudo" >&2
    exit 2
fi

missing=""
command -v qemu-aarch64-static >/dev/null || missing="$missing qemu-user-static"
command -v update-binfmts >/dev/null || missing="$missing binfmt-support"
command -v mmdebstrap >/dev/null || missing="$missing mmdebstrap"
# mmdebstrap only recommends arch-test, which --no-install-recommends leaves out; without it
# a foreign-architecture root filesystem stops at "install arch-test".
command -v arch-test >/dev/null || missing="$missing arch-test"
if [ -n "$missing" ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
# binfmt_misc: every aarch64 exec in the root filesystem (pip, gcc's cc1/as/ld, the server)
# runs through qemu-aarch64-static. The F flag opens the interpreter at registration, so
# it works inside the chroot without a copy there.
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || {
    echo "qemu-aarch64 is registered without the F flag: a chroot cannot find it" >&2; exit 2; }

# One run at a time per cache: runs share the root filesystem (and its /opt/ling3-rknn).
cache="${LING3_AARCH64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ling3-rknn/aarch64-rootfs}"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock -n 9 || { echo "waiting for another aarch64 tier run ($cache/.lock)"; flock 9; }
root="$("$here/rootfs.sh")"
echo "== root filesystem: $root ($((SECONDS - started)) s so far)"

# The x86 side of the greedy comparison, from the same tree on this host.
work="$(mktemp -d)"
cleanup() {
    for m in proc/cpuinfo proc sys dev/pts dev root/.cache/pip; do
        mountpoint -q "$root/$m" && umount -l "$root/$m"
    done
    rm -rf "$work" "$root/src"
}
trap cleanup EXIT
echo "== x86 answers of the demo bundle"
"$venv/bin/python" "$here/greedy_answers.py" --out "$work/answers-x86_64.json"
"$venv/bin/python" "$here/kernel_errors.py" --out "$work/kernel-errors-x86_64.json"

# The package exactly as a user installs it: a wheel (PyPI's form), its [board] extra.
"$venv/bin/pip" wheel --quiet --no-deps -w "$work/dist" "$repo"

# What board.sh reads: the wheel, the tests (the package itself comes from the wheel), the
# systemd unit and its environment file, the x86 answers.
rm -rf "$root/src" && mkdir -p "$root/src"
cp -a "$repo/tests" "$repo/systemd" "$repo/pyproject.toml" "$work/dist" "$root/src/"
rm -rf "$root/src/tests/server_clients/node_modules"
cp "$work"/*.json "$root/src/"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# pip inside reaches PyPI as the host's pip does: the host's trust store (a TLS-inspecting
# proxy's CA included) and its proxy and index settings.
cp "${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}" "$root/src/host-ca.crt"
pass_env=(PIP_CERT=/src/host-ca.crt)
for name in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL \
        PIP_DEFAULT_TIMEOUT; do
    [ -n "${!name:-}" ] && pass_env+=("$name=${!name}")
done

mount -t proc proc "$root/proc"
# The board's /proc/cpuinfo: gcc's -march=native reads it (QEMU 7.2 passes the host's
# through), so the kernels are compiled for an RK3588's A76/A55 features as on the board.
mount --bind "$here/rk3588-cpuinfo" "$root/proc/cpuinfo"
mount --rbind /dev "$root/dev"
mount -t sysfs sysfs "$root/sys" 2>/dev/null || mount --rbind /sys "$root/sys"
# Wheels downloaded once, outside the repository and outside the cached image.
pip_cache="$cache/../aarch64-pip"
mkdir -p "$pip_cache" "$root/root/.cache/pip"
mount --bind "$pip_cache" "$root/root/.cache/pip"

echo "== into the aarch64 root filesystem ($((SECONDS - started)) s so far)"
# cortex-a76: the RK3588's big core, which QEMU 7.2 models (NEON, fp16, dot product).
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "${pass_env[@]}" \
    QEMU_CPU="${QEMU_CPU:-cortex-a76}" BOARD_TIER="${BOARD_TIER:-all}" \
    nice -n 10 chroot "$root" /bin/bash /src/tests/aarch64/board.sh
echo "== aarch64 tier passed in $((SECONDS - started)) s"

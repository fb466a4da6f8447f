#!/usr/bin/env bash
# Build (once) the Debian 12 aarch64 root filesystem of the emulated board and print its
# path. Cached outside the repository, keyed by a hash of this script and the package list,
# so an edit to either builds a new one and an unchanged tree reuses it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${LING3_AARCH64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ling3-rknn/aarch64-rootfs}"
key="$(cat "$here/rootfs.sh" "$here/rootfs-packages.txt" | sha256sum | cut -c1-16)"
root="$cache/$key"
if [ -f "$root/.complete" ]; then
    echo "$root"
    exit 0
fi
mkdir -p "$cache"
rm -rf "$root.tmp"
packages="$(grep -v '^#' "$here/rootfs-packages.txt" | xargs | tr ' ' ',')"
# --variant=apt: Essential packages and apt, then only the list above (no recommends),
# the smallest image a board user's steps run on. Package scripts run under qemu-user
# through binfmt_misc (tests/aarch64/run.sh registers it).
nice -n 10 mmdebstrap --arch=arm64 --variant=apt --include="$packages" \
    --aptopt='APT::Install-Recommends "false"' \
    bookworm "$root.tmp" "${LING3_AARCH64_MIRROR:-http://deb.debian.org/debian}" >&2
touch "$root.tmp/.complete"
mv "$root.tmp" "$root"
echo "$root"

#!/bin/sh
# Pin the RK3588's CPU, NPU and DDR clocks to their performance governors, or undo it.
#
#   sudo board/governors.sh apply     # CPU cpufreq policies, NPU devfreq, DDR (dmc) devfreq
#   sudo board/governors.sh undo      # restore what apply found
#   board/governors.sh status         # print each governor and current frequency
#
# Why: with the default ondemand-style governors the DDR clock idles at 528 MHz much of
# the time and the NPU ramps late; a decoded token is a memory-traffic problem, so the
# memory clock matters most (docs/performance.md). Idempotent: a governor that is already
# "performance" is left alone and reported as unchanged. apply records the previous
# governors in $STATE (once: a second apply does not overwrite them), undo puts them back.
# SYSFS_ROOT (default empty) prefixes every sysfs path, so tests run it on a fake tree.
set -eu

ROOT="${SYSFS_ROOT:-}"
STATE="${LING3_RKNN_GOVERNOR_STATE:-/var/lib/ling3-rknn/governors.saved}"

# "path-to-governor-file path-to-available-list" per clock domain present on this board.
domains() {
    for policy in "$ROOT"/sys/devices/system/cpu/cpufreq/policy*; do
        [ -f "$policy/scaling_governor" ] || continue
        echo "$policy/scaling_governor $policy/scaling_available_governors"
    done
    for dev in fdab0000.npu dmc; do
        d="$ROOT/sys/class/devfreq/$dev"
        [ -f "$d/governor" ] && echo "$d/governor $d/available_governors"
    done
    return 0
}

current_freq() {
    dir=$(dirname "$1")
    for f in "$dir/scaling_cur_freq" "$dir/cur_freq"; do
        [ -f "$f" ] && { cat "$f"; return; }
    done
    echo "?"
}

status() {
    domains | while read -r gov avail; do
        echo "$(dirname "${gov#"$ROOT"}"): $(cat "$gov") at $(current_freq "$gov")"
    done
}

apply() {
    mkdir -p "$(dirname "$STATE")"
    [ -f "$STATE" ] || domains | while read -r gov avail; do
        echo "${gov#"$ROOT"} $(cat "$gov")"
    done > "$STATE"
    domains | while read -r gov avail; do
        name=$(dirname "${gov#"$ROOT"}")
        now=$(cat "$gov")
        if [ "$now" = performance ]; then
            echo "$name: performance (unchanged)"
        elif grep -qw performance "$avail" 2>/dev/null; then
            echo performance > "$gov"
            echo "$name: $now -> performance"
        else
            echo "$name: no performance governor offered (available: $(cat "$avail" 2>/dev/null))" >&2
        fi
    done
}

undo() {
    if [ ! -f "$STATE" ]; then
        echo "nothing to undo: $STATE not found (apply was not run)" >&2
        return 1
    fi
    while read -r path old; do
        gov="$ROOT$path"
        [ -f "$gov" ] || continue
        now=$(cat "$gov")
        if [ "$now" = "$old" ]; then
            echo "$(dirname "$path"): $old (unchanged)"
        else
            echo "$old" > "$gov"
            echo "$(dirname "$path"): $now -> $old"
        fi
    done < "$STATE"
    rm -f "$STATE"
}

case "${1:-}" in
    apply) apply ;;
    undo) undo ;;
    status) status ;;
    *) echo "usage: $0 apply|undo|status" >&2; exit 2 ;;
esac

#!/bin/bash
# Inside the emulated board (tests/aarch64/run.sh): install the project the way
# docs/board-guide.md tells a user, then run the tier's four parts. BOARD_TIER selects
# them: "all" or a comma list of install,kernels,serve,board,unit ("install" always runs).
set -euo pipefail
cd /src
tier="${BOARD_TIER:-all}"
want() { [ "$tier" = all ] || [[ ",$tier," == *",$1,"* ]]; }
step() { echo "== [$(date -u +%T)] $*"; }
t0=$SECONDS
echo "machine: $(uname -m), python: $(python3 --version), gcc: $(gcc -dumpfullversion)," \
    "QEMU_CPU=${QEMU_CPU:-}"
[ "$(uname -m)" = aarch64 ] || { echo "not aarch64: run through tests/aarch64/run.sh" >&2; exit 2; }

# --- the board guide, section 2 (gcc is in the cached root filesystem already) ----------
step "install: python3 -m venv .venv && .venv/bin/pip install 'ling3-rknn[board]'"
# a fresh install every run, the kernels compiled again by this gcc
rm -rf /opt/ling3-rknn /etc/ling3-rknn /var/lib/ling3-rknn /tmp/ling3-state
mkdir -p /opt/ling3-rknn && cd /opt/ling3-rknn
python3 -m venv .venv
wheel="$(ls /src/dist/ling3_rknn-*.whl)"
.venv/bin/pip install --quiet --disable-pip-version-check "$wheel[board]"
.venv/bin/pip check
step "install: .venv/bin/ling3-rknn build-kernels (the decode kernels, for this CPU)"
.venv/bin/ling3-rknn build-kernels
.venv/bin/python - <<'PY'
from importlib.metadata import version
for name in ("ling3-rknn", "rknn-toolkit-lite2", "onnxruntime", "numpy", "tokenizers",
             "llguidance"):
    print(f"  {name} {version(name)}")
PY
# The test runner only, into the same environment (never part of what a user installs).
.venv/bin/pip install --quiet --disable-pip-version-check pytest pytest-asyncio hypothesis \
    openai
py=/opt/ling3-rknn/.venv/bin/python
echo "install: $((SECONDS - t0)) s"
cd /src
# pytest from the venv's script (not python -m), so /src is not on sys.path: the package
# under test is the installed wheel, its C sources compiled by this gcc.
pytest=(/opt/ling3-rknn/.venv/bin/pytest -p no:cacheprovider -q)
# No NPU under emulation: bundles load on the RKNNLite mock (onnxruntime's aarch64 build),
# which auto would not pick here, the real rknnlite being installed; the real binding is
# checked on its own in tests/aarch64/test_board_tier.py.
export PYTHONDONTWRITEBYTECODE=1 LING3_RKNN_STATE_DIR=/tmp/ling3-state LING3_NPU_RUNTIME=mock
# the board's own build only (not also armv8-a: the board never runs it; x86 runs every width)
export LING3_RKNN_TEST_MARCH=native

if want kernels; then
    step "1. decode kernels (NEON, _Float16) against numpy; oracle decode; float16 latents;" \
        "the NPU matmul binding on its stand-in; attention and experts' steps around it"
    t=$SECONDS
    "${pytest[@]}" tests/test_native_kernels.py tests/test_model_oracle.py \
        tests/test_latent_fp16.py tests/test_mla_expanded.py tests/test_npu_matmul.py \
        tests/test_mla_npu.py tests/test_attn_softmax.py tests/test_moe_int8.py \
        tests/test_model_pipeline.py
    "$py" tests/aarch64/kernel_errors.py --out /src/kernel-errors-aarch64.json \
        --compare /src/kernel-errors-x86_64.json
    echo "kernels: $((SECONDS - t)) s"
fi

if want serve; then
    step "2. the demo bundle served on aarch64 (RKNNLite mock on onnxruntime), greedy vs x86"
    t=$SECONDS
    "$py" tests/aarch64/greedy_answers.py \
        --ling3-rknn /opt/ling3-rknn/.venv/bin/ling3-rknn \
        --out /src/answers-aarch64.json --compare /src/answers-x86_64.json
    echo "serve: $((SECONDS - t)) s"
fi

if want board; then
    step "3. doctor on a fake CM3588, thread policy, the real rknn-toolkit-lite2 wheel"
    t=$SECONDS
    "${pytest[@]}" tests/test_doctor.py tests/test_cpu_threads.py tests/aarch64/test_board_tier.py
    echo "board: $((SECONDS - t)) s"
fi

if want unit; then
    step "4. the systemd unit's ExecStart as the unit runs it, up to /health"
    t=$SECONDS
    "$py" tests/aarch64/unit_start.py systemd/ling3-rknn.service systemd/ling3-rknn.env
    echo "unit: $((SECONDS - t)) s"
fi
echo "aarch64 board tier: $((SECONDS - t0)) s inside the root filesystem"

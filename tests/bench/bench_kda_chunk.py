"""``kda_chunk.c`` against an earlier revision of itself, at Ling-3.0-tiny's size.

The KDA prefill kernel is the largest CPU term once the NPU runs prefill's matmuls
(``bench_npu_residue.py``'s ``kda_share``). This compares the working tree's kernel with
the one at ``--against`` (a git revision) in one process: each source compiled alone
(``kda_chunk.c`` with its headers, the build's flags, for each ``--march``), called through
ctypes on the same 256-token piece of 16 heads x 128 in chunks of 64, one thread. Each head
is timed on its own, interleaved between the two builds, best of ``--rounds`` (the machine
is shared: the minimum is the cost), and the heads' minima summed. Prints ms per token and
layer, GFLOP/s (~136 KFLOP per token and head: the decayed KK and QK products, the
triangular solve for [U | W], W S, (q e^G) S, QK V' and the state update) and the largest
difference between the two builds' outputs and states. Nothing asserts on time.

    .venv/bin/python tests/bench/bench_kda_chunk.py [--against HEAD] [--rounds 10]
        [--march native,x86-64-v3,x86-64]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from ling3_rknn.model import native_build
from ling3_rknn.model.kda import prepare_qkv

FILES = ("kda_chunk.c", "native_vec.h", "native_abi.h")
SUB = 16  # LING3_KDA_SUB at the time of writing; scratch is sized generously below
FLOP_PER_TOKEN_HEAD = 136e3
TOKENS, HEADS, D, CHUNK = 256, 16, 128, 64


def _sources(rev: str | None, into: Path) -> Path:
    """The kernel's sources at ``rev`` (None: the working tree) in a directory of their own."""
    into.mkdir(parents=True)
    for name in FILES:
        path = native_build.SOURCE_DIR / name
        if rev is None:
            text = path.read_text()
        else:
            repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                                  capture_output=True, text=True,
                                  cwd=native_build.SOURCE_DIR).stdout.strip()
            rel = path.relative_to(repo)
            text = subprocess.run(["git", "show", f"{rev}:{rel}"], check=True,
                                  capture_output=True, text=True, cwd=repo).stdout
        (into / name).write_text(text)
    return into


def _build(src: Path, march: str) -> ctypes.CDLL:
    cc = native_build.compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    out = src / f"kda-{march}.so"
    flags = [*native_build._COMMON_FLAGS, *native_build.machine_flags(march=march)]
    subprocess.run([cc, *flags, "-o", str(out), str(src / "kda_chunk.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.kda_chunk_heads.restype = ctypes.c_int
    return lib


def _inputs(seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((TOKENS, 3 * HEADS * D)).astype(np.float32)
    q, k, v = prepare_qkv(conv, HEADS, D)
    log_decay = (-5.0 / (1.0 + np.exp(-2.0 * rng.standard_normal((TOKENS, HEADS, D))))
                 ).astype(np.float32)
    beta = rng.random((TOKENS, HEADS)).astype(np.float32)
    state = (0.3 * rng.standard_normal((HEADS, D, D))).astype(np.float32)
    return [np.ascontiguousarray(a) for a in (q, k, v, log_decay, beta)], state


def _run(lib: ctypes.CDLL, arrays: list[np.ndarray], state0: np.ndarray, h0: int, h1: int
         ) -> tuple[float, np.ndarray, np.ndarray]:
    state, out = state0.copy(), np.empty_like(arrays[2])
    scratch = np.empty(CHUNK * (5 * D + 2 * CHUNK + 1) + (SUB + 2) * D, np.float32)
    ptr = [ctypes.c_void_p(a.ctypes.data) for a in arrays]
    start = time.perf_counter()
    status = lib.kda_chunk_heads(*ptr, TOKENS, HEADS, D, CHUNK,
                                 ctypes.c_void_p(state.ctypes.data),
                                 ctypes.c_void_p(out.ctypes.data), h0, h1,
                                 ctypes.c_void_p(scratch.ctypes.data))
    elapsed = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"kda_chunk_heads returned {status}")
    return elapsed, out, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--march", default=",".join(native_build.marches_here()))
    args = parser.parse_args()
    arrays, state0 = _inputs()
    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(1):
        dirs = {args.against: _sources(args.against, Path(tmp) / "old"),
                "worktree": _sources(None, Path(tmp) / "new")}
        for march in args.march.split(","):
            libs = {name: _build(src, march) for name, src in dirs.items()}
            results = {name: _run(lib, arrays, state0, 0, HEADS)[1:] for name, lib in libs.items()}
            best = {name: [float("inf")] * HEADS for name in libs}
            for _ in range(args.rounds):
                for h in range(HEADS):
                    for name, lib in libs.items():
                        best[name][h] = min(best[name][h], _run(lib, arrays, state0, h, h + 1)[0])
            (out_a, state_a), (out_b, state_b) = results.values()
            diff = max(float(np.abs(out_a - out_b).max()), float(np.abs(state_a - state_b).max()))
            for name, heads in best.items():
                seconds = sum(heads)
                print(f"{march:10s} {name:10s} {seconds / TOKENS * 1e3:.4f} ms/token/layer "
                      f"{FLOP_PER_TOKEN_HEAD * TOKENS * HEADS / seconds / 1e9:6.1f} GFLOP/s")
            old, new = (sum(h) for h in best.values())
            print(f"{march:10s} speedup {old / new:.2f}x, largest difference {diff:.3g}")


if __name__ == "__main__":
    main()

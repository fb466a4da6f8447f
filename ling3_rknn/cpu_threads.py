"""The process's CPU thread policy: which cores compute, and how many threads each pool gets.

Every CPU pool in the runtime takes its size from here: onnxruntime sessions (routed
experts, ``--target cpu`` stage graphs), the MLA attention split, and BLAS. Left
alone, numpy's BLAS starts one thread per core for every small GEMM of the glue and
onnxruntime spins its idle workers: on a busy 2-core host that measured 3x slower decode
than one explicit thread per pool (docs/performance.md). So the policy is set once, by the
loader, and nothing depends on environment variables a user would have to know.

- Cores: on a big.LITTLE SoC (the RK3588: four Cortex-A55 at capacity ~414 and four
  Cortex-A76 at 1024 in ``/sys/devices/system/cpu/cpuN/cpu_capacity``) the process is
  pinned to the biggest cores it is allowed to use, never the little ones. Elsewhere it
  keeps the cores it was given (``sched_getaffinity``: taskset, cgroups, systemd's
  ``CPUAffinity=`` are respected, never widened).
- Threads: ``--threads`` or, by default, one per chosen core (at most 4).
- BLAS is held to one thread: the glue's BLAS calls are small and the parallel work is
  split explicitly by the compiled kernels and onnxruntime, so BLAS threads only compete.
- onnxruntime workers never spin (``session.intra_op.allow_spinning = 0``): a spinning
  worker steals the core the NPU driver and the other pools need.
- onnxruntime workers are pinned one per core to the chosen cores after the first
  (``pool_worker_cores``); the thread that calls into the pool stays free on all of them.
  Left to the scheduler, a woken worker often lands on the core of the thread that woke
  it and the two share one core while the other idles: pinned, 2-thread decode was 5 %
  faster on a quiet 2-core host and 17 % faster with another busy process on it
  (docs/performance.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_DEFAULT_THREADS = 4
_SYS_CPU = Path("/sys/devices/system/cpu")
_DT_COMPATIBLE = Path("/proc/device-tree/compatible")


class ThreadPolicyError(ValueError):
    """A ``--threads`` value the machine cannot honour."""


def allowed_cpus() -> list[int]:
    """The cores this process may run on (all online ones where affinity is unsupported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def biggest_cores(cpus: list[int], sys_cpu: Path = _SYS_CPU) -> list[int]:
    """The subset of ``cpus`` with the highest ``cpu_capacity``; all of them when the
    kernel reports no capacities (x86, most VMs) or they are all equal."""
    capacity: dict[int, int] = {}
    for cpu in cpus:
        try:
            capacity[cpu] = int((sys_cpu / f"cpu{cpu}" / "cpu_capacity").read_text())
        except (OSError, ValueError):
            return list(cpus)
    best = max(capacity.values(), default=0)
    return [cpu for cpu in cpus if capacity[cpu] == best]


def is_rk3588(compatible: Path = _DT_COMPATIBLE) -> bool:
    """Whether the device tree names an RK3588 (or RK3588S) SoC."""
    try:
        return b"rockchip,rk3588" in compatible.read_bytes()
    except OSError:
        return False


@dataclass(frozen=True)
class ThreadPolicy:
    """``threads`` per pool, run on ``cpus``."""

    threads: int
    cpus: tuple[int, ...]

    @classmethod
    def resolve(cls, threads: int | None = None, *, cpus: list[int] | None = None,
                sys_cpu: Path = _SYS_CPU) -> ThreadPolicy:
        """The policy for this machine; ``threads`` None means one per chosen core."""
        chosen = biggest_cores(cpus if cpus is not None else allowed_cpus(), sys_cpu)
        if threads is None:
            threads = min(len(chosen), MAX_DEFAULT_THREADS)
        elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ThreadPolicyError(f"threads must be a positive integer, got {threads!r}")
        elif threads > len(chosen):
            raise ThreadPolicyError(
                f"--threads {threads} is more than the {len(chosen)} cores this process "
                f"may use for compute ({_cpu_list(chosen)}); more threads than cores only "
                "makes them wait for each other")
        return cls(threads, tuple(chosen))

    def apply(self) -> None:
        """Pin every thread of the process to ``cpus`` and hold BLAS to one thread.

        Idempotent; onnxruntime pools are sized where their sessions are created (they
        take ``threads`` from the loader) and inherit the affinity set here.
        """
        _pin_process(self.cpus)
        _limit_blas()
        log.info("CPU policy: %d thread(s) per pool on cores %s", self.threads,
                 _cpu_list(list(self.cpus)))


_applied: ThreadPolicy | None = None


def apply_thread_policy(threads: int | None = None) -> ThreadPolicy:
    """Resolve and apply the policy once per process; a later call with the same or no
    explicit count returns the one in force (loading a second model changes nothing)."""
    global _applied
    if _applied is not None and threads in (None, _applied.threads):
        return _applied
    policy = ThreadPolicy.resolve(threads)
    policy.apply()
    _applied = policy
    return policy


def pool_worker_cores(threads: int) -> tuple[int, ...]:
    """The core of each of the ``threads - 1`` workers of an intra-op pool of ``threads``
    (the calling thread is the pool's other thread and is not pinned): the cores of the
    policy in force after its first, one worker per core, round robin when there are
    more workers than cores. Empty (leave the workers to the scheduler) when no policy
    is in force, for a single-thread pool, or on a single core."""
    policy = _applied
    if policy is None or threads < 2 or len(policy.cpus) < 2:
        return ()
    others = policy.cpus[1:]
    return tuple(others[i % len(others)] for i in range(threads - 1))


def _cpu_list(cpus: list[int]) -> str:
    return "cpu" + ",".join(str(c) for c in cpus)


def _pin_process(cpus: tuple[int, ...]) -> None:
    if not hasattr(os, "sched_setaffinity"):
        return
    target = set(cpus)
    # sched_setaffinity(0) pins only the calling thread: pin every thread already
    # running (BLAS/onnxruntime pools started at import), later ones inherit it.
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) != target:
                os.sched_setaffinity(tid, target)
        except OSError:  # the thread ended meanwhile, or a sandbox forbids it
            continue


def _limit_blas() -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


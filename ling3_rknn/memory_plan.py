"""How much of the machine's memory the serving process may take beyond the model itself.

Two consumers have sizes an operator can set and that a board cannot always afford at their
defaults: the prefix cache's memory tier (``--cache-bytes``, default 2 GiB) and the live
sequence's expanded-MLA prefill scratch (``--prefill-scratch``, default 2 GiB; held while
the conversation goes on). Ling-3.0-tiny's bundle is ~5.7 GB, so on an 8 GB CM3588 the two
defaults alone would push the process into swap or the OOM killer. What the operator did not
set is sized here, at load, from what the machine has left (docs/performance.md, "Where the
memory goes"):

    spare = min(MemAvailable, MemTotal - model bytes) - one sequence at the context limit
            - RUNTIME_RESERVE

``MemAvailable`` is read after the model loaded, both figures capped by the process's
cgroup limit when it has one (a container's ``--memory``, systemd's ``MemoryMax=``: the
kernel holds the process to it whatever the machine has); ``MemTotal - model bytes`` also covers
model pages that are memory-mapped but not yet resident (which MemAvailable still counts as
free). The unset consumers split ``spare`` evenly, each up to its default, and one's unused
share goes to the other; the cache first gets what one sequence at the context limit needs
(the largest snapshot it may be asked to keep: a snapshot bigger than the cache is not
kept at all) when ``spare`` has it. Values the operator set are kept as given (a warning
says when they exceed ``spare``). Where ``/proc/meminfo`` lacks the figures (not Linux) the
defaults stand.

A third consumer is decided before the model loads: the routed experts' int8 copy for
prefill on the NPU (``choose_npu_experts``; ~6.9 GB for Ling-3.0-tiny, NPU memory being the
board's own RAM). It is taken when, after the model and the copy, one sequence at the
context limit and the runtime reserve, the cache and the prefill scratch still get at least
one sequence at the context limit each: a 16 or 32 GB CM3588 takes it, a 4 or 8 GB one
keeps the routed experts on the CPU only (docs/performance.md, "What a board cannot spare").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MEMINFO_PATH = Path("/proc/meminfo")
CGROUP_PATH = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Python, onnxruntime's arenas and sessions, the HTTP server, the OS's own working set
RUNTIME_RESERVE = 1 << 30
_GIB = float(1 << 30)


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo``'s fields in bytes (``kB`` lines scaled, others as written)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def read_meminfo(path: Path = MEMINFO_PATH) -> dict[str, int] | None:
    """The machine's memory figures, or None where the file is missing or unreadable."""
    try:
        return parse_meminfo(path.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 says "max" for no limit


def cgroup_memory(cgroup: Path = CGROUP_PATH, root: Path = CGROUP_ROOT
                  ) -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup, v2 or v1, or None without
    a limit. The path in ``/proc/self/cgroup`` is tried below ``root`` and, as inside a
    container's namespace, at ``root`` itself."""
    try:
        lines = cgroup.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2: the unified hierarchy
            names, base = ("memory.max", "memory.current"), root
        elif "memory" in controllers.split(","):  # v1: the memory controller's own tree
            names, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), root / "memory"
        else:
            continue
        for where in (base / rel.lstrip("/"), base):
            limit, usage = (_read_int(where / n) for n in names)
            # v1 reports "no limit" as a huge number (2^63 rounded to pages)
            if limit is not None and usage is not None and limit < 1 << 60:
                return limit, usage
    return None


def machine_memory() -> dict[str, int] | None:
    """``MemTotal`` and ``MemAvailable`` as this process may use them: ``/proc/meminfo``,
    capped by its cgroup's limit (and the limit less what the cgroup already holds)."""
    info = read_meminfo()
    if info is None:
        return None
    return capped_by_cgroup(info, cgroup_memory())


def capped_by_cgroup(info: Mapping[str, int], limited: tuple[int, int] | None
                     ) -> dict[str, int]:
    """``MemTotal`` and ``MemAvailable`` of ``info`` capped by a cgroup's (limit, usage)."""
    capped = dict(info)
    if limited is None or "MemTotal" not in capped or "MemAvailable" not in capped:
        return capped
    limit, usage = limited
    capped["MemTotal"] = min(capped["MemTotal"], limit)
    capped["MemAvailable"] = min(capped["MemAvailable"], max(0, limit - usage))
    return capped


@dataclass(frozen=True)
class NpuExpertsChoice:
    """Whether the routed experts' int8 copy is loaded for prefill on the NPU, and why."""

    copy_bytes: int  # the copy's size in the bundle (0: the bundle has none)
    taken: bool
    reason: str

    def describe(self) -> str:
        if not self.copy_bytes:
            return "NPU experts: none in the bundle (routed experts on the CPU)"
        return (f"NPU experts: int8 copy {_gib(self.copy_bytes)} "
                f"{'loaded' if self.taken else 'not loaded'} ({self.reason})")


def choose_npu_experts(*, copy_bytes: int, model_bytes: int, sequence_bytes: int,
                       meminfo: Mapping[str, int] | None, force: bool | None = None
                       ) -> NpuExpertsChoice:
    """Take the int8 copy (``copy_bytes``) beside a model of ``model_bytes`` when the
    machine keeps, after both, one sequence at the context limit, the runtime reserve and
    two more such sequences (the prefix cache's one snapshot, the prefill scratch's rows);
    ``force`` True / False decides instead (for tests and measurements)."""
    if not copy_bytes:
        return NpuExpertsChoice(0, False, "the bundle has no int8 copy")
    if force is not None:
        return NpuExpertsChoice(copy_bytes, force, f"forced {'on' if force else 'off'}")
    total = meminfo.get("MemTotal") if meminfo else None
    available = meminfo.get("MemAvailable") if meminfo else None
    if total is None or available is None:
        return NpuExpertsChoice(copy_bytes, False, "the machine's memory is not readable")
    left = (min(available, total) - model_bytes - copy_bytes - sequence_bytes
            - RUNTIME_RESERVE)
    need = 2 * sequence_bytes
    if left >= need:
        return NpuExpertsChoice(copy_bytes, True, f"{_gib(left)} left beside it")
    return NpuExpertsChoice(copy_bytes, False,
                            f"{_gib(max(left, 0))} would be left beside it, under the "
                            f"{_gib(need)} the cache and the prefill scratch need")


@dataclass(frozen=True)
class MemoryPlan:
    """The sizes the process runs with, and the figures they came from."""

    cache_bytes: int
    prefill_scratch_bytes: int
    spare_bytes: int | None  # None: the machine's memory was not readable
    total_bytes: int | None
    available_bytes: int | None
    model_bytes: int
    sequence_bytes: int
    auto: tuple[str, ...]  # which of the two were sized here ("cache", "prefill scratch")
    over_by: int = 0  # how far the operator's values exceed ``spare_bytes``
    npu_experts: NpuExpertsChoice | None = None  # the int8 expert copy (in model_bytes if taken)

    def warnings(self) -> list[str]:
        """What an operator should know about these sizes (empty when all is well)."""
        found = []
        if self.over_by:
            found.append(f"the sizes set exceed this machine's spare memory by "
                         f"{_gib(self.over_by)}: expect swapping or the OOM killer under long "
                         "prompts")
        if self.spare_bytes is not None and self.cache_bytes < self.sequence_bytes:
            found.append(f"the prefix cache ({_gib(self.cache_bytes)}) cannot keep a snapshot "
                         f"of a prompt at the context limit ({_gib(self.sequence_bytes)}): "
                         "long prompts are not cached; --latent-cache float16 or a smaller "
                         "--max-context shrink them")
        return found

    def describe(self) -> str:
        """One log line: the sizes, which were chosen here, and from what."""
        sizes = (f"prefix cache {_gib(self.cache_bytes)} in memory, prefill scratch "
                 f"{_gib(self.prefill_scratch_bytes)}")
        if self.npu_experts is not None:
            sizes += f"; {self.npu_experts.describe()}"
        if self.spare_bytes is None:
            return (f"memory: {sizes} (the defaults: MemTotal and MemAvailable are not readable "
                    "here)")
        chosen = f"; sized here: {', '.join(self.auto)}" if self.auto else ""
        return (f"memory: {sizes}{chosen} (of {_gib(self.total_bytes or 0)}: model "
                f"{_gib(self.model_bytes)}, one sequence at the context limit "
                f"{_gib(self.sequence_bytes)}, runtime reserve {_gib(RUNTIME_RESERVE)}, "
                f"{_gib(self.available_bytes or 0)} available after loading, "
                f"{_gib(self.spare_bytes)} spare)")


def plan_memory(
    *,
    model_bytes: int,
    sequence_bytes: int,
    meminfo: Mapping[str, int] | None,
    cache_bytes: int | None,
    prefill_scratch_bytes: int | None,
    default_cache_bytes: int,
    default_prefill_scratch_bytes: int,
    npu_experts: NpuExpertsChoice | None = None,
    scratch_first_bytes: int = 0,
) -> MemoryPlan:
    """The sizes for the consumers left ``None`` (see the module docstring).
    ``npu_experts``: the int8 copy's choice, carried into the plan's report (its bytes are
    already in ``model_bytes`` when it was taken). ``scratch_first_bytes``: what the prefill
    scratch should get before the cache's halves (the NPU attention's rows for a prompt at
    the context limit: without them an agent's first request falls back to the CPU), after
    the cache's one snapshot."""
    total = meminfo.get("MemTotal") if meminfo else None
    available = meminfo.get("MemAvailable") if meminfo else None
    if total is None or available is None:
        return MemoryPlan(
            cache_bytes=default_cache_bytes if cache_bytes is None else cache_bytes,
            prefill_scratch_bytes=(default_prefill_scratch_bytes
                                   if prefill_scratch_bytes is None else prefill_scratch_bytes),
            spare_bytes=None, total_bytes=total, available_bytes=available,
            model_bytes=model_bytes, sequence_bytes=sequence_bytes, auto=(),
            npu_experts=npu_experts)
    spare = max(0, min(available, total - model_bytes) - sequence_bytes - RUNTIME_RESERVE)
    fixed = (cache_bytes or 0) + (prefill_scratch_bytes or 0)
    free = max(0, spare - fixed)
    auto: list[str] = []
    if cache_bytes is None and prefill_scratch_bytes is None:
        # one full-context snapshot first, then halves; each share at most its default
        cache = min(default_cache_bytes, max(free // 2, min(free, sequence_bytes)))
        if scratch_first_bytes:  # the NPU rows before the cache's half
            cache = min(cache, max(min(free, sequence_bytes), free - scratch_first_bytes))
        scratch = min(default_prefill_scratch_bytes, free - cache)
        cache = min(default_cache_bytes, free - scratch)  # what the scratch left
        auto = ["cache", "prefill scratch"]
    elif cache_bytes is None:
        scratch = prefill_scratch_bytes or 0
        cache = min(default_cache_bytes, free)
        auto = ["cache"]
    elif prefill_scratch_bytes is None:
        cache = cache_bytes
        scratch = min(default_prefill_scratch_bytes, free)
        auto = ["prefill scratch"]
    else:
        cache, scratch = cache_bytes, prefill_scratch_bytes
    return MemoryPlan(cache_bytes=cache, prefill_scratch_bytes=scratch, spare_bytes=spare,
                      total_bytes=total, available_bytes=available, model_bytes=model_bytes,
                      sequence_bytes=sequence_bytes, auto=tuple(auto),
                      over_by=max(0, fixed - spare), npu_experts=npu_experts)


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"

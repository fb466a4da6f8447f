"""The memory plan: the prefix cache and the prefill scratch sized from what a machine has
left beside the model, so an 8 GB board is not pushed into swap by the 2 GiB defaults."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ling3_rknn import demo, loading
from ling3_rknn.bundle import Bundle
from ling3_rknn.loading import LoadOptions
from ling3_rknn.memory_plan import (
    RUNTIME_RESERVE,
    cgroup_memory,
    choose_npu_experts,
    parse_meminfo,
    plan_memory,
    read_meminfo,
)

GIB = 1 << 30
DEFAULTS = dict(default_cache_bytes=2 * GIB, default_prefill_scratch_bytes=2 * GIB)


def board(total_gib: float, available_gib: float) -> dict[str, int]:
    return {"MemTotal": int(total_gib * GIB), "MemAvailable": int(available_gib * GIB)}


def test_meminfo_lines_are_read_in_bytes() -> None:
    text = "MemTotal:        8039208 kB\nMemAvailable:    1520000 kB\nHugePages_Total:       0\n"
    info = parse_meminfo(text)
    assert info == {"MemTotal": 8039208 * 1024, "MemAvailable": 1520000 * 1024,
                    "HugePages_Total": 0}


def test_an_unreadable_meminfo_is_none(tmp_path: Path) -> None:
    assert read_meminfo(tmp_path / "missing") is None


def test_an_8gb_board_gets_what_it_can_spare_not_the_defaults() -> None:
    # Ling-3.0-tiny's 5.3 GiB bundle, 2.3 GiB left after loading, one 32K sequence
    plan = plan_memory(model_bytes=int(5.33 * GIB), sequence_bytes=int(0.44 * GIB),
                       meminfo=board(7.7, 2.3), cache_bytes=None, prefill_scratch_bytes=None,
                       **DEFAULTS)
    spare = int(2.3 * GIB) - int(0.44 * GIB) - RUNTIME_RESERVE
    assert plan.spare_bytes == spare
    assert plan.cache_bytes + plan.prefill_scratch_bytes == spare
    # the cache first holds one snapshot at the context limit, the rest is split
    assert plan.cache_bytes == int(0.44 * GIB) and plan.prefill_scratch_bytes > 0.4 * GIB
    assert plan.auto == ("cache", "prefill scratch") and plan.over_by == 0
    assert plan.warnings() == []


def test_a_cache_too_small_for_one_long_snapshot_takes_all_and_is_flagged() -> None:
    plan = plan_memory(model_bytes=int(5.33 * GIB), sequence_bytes=int(0.44 * GIB),
                       meminfo=board(7.7, 1.7), cache_bytes=None, prefill_scratch_bytes=None,
                       **DEFAULTS)
    assert 0 < plan.cache_bytes == plan.spare_bytes < int(0.44 * GIB)
    assert plan.prefill_scratch_bytes == 0
    (warning,) = plan.warnings()
    assert "cannot keep a snapshot" in warning and "--latent-cache float16" in warning


def test_model_pages_not_yet_resident_still_count() -> None:
    # MemAvailable right after mapping the experts still counts their pages as free
    plan = plan_memory(model_bytes=int(5.9 * GIB), sequence_bytes=0, meminfo=board(7.7, 7.0),
                       cache_bytes=None, prefill_scratch_bytes=None, **DEFAULTS)
    assert plan.spare_bytes == int(7.7 * GIB) - int(5.9 * GIB) - RUNTIME_RESERVE


def test_a_16gb_board_keeps_the_defaults() -> None:
    plan = plan_memory(model_bytes=int(5.9 * GIB), sequence_bytes=int(0.46 * GIB),
                       meminfo=board(15.6, 9.0), cache_bytes=None, prefill_scratch_bytes=None,
                       **DEFAULTS)
    assert (plan.cache_bytes, plan.prefill_scratch_bytes) == (2 * GIB, 2 * GIB)


def test_one_consumer_capped_leaves_the_rest_to_the_other() -> None:
    # 4 GiB spare: each takes its 2 GiB half; with a 0.5 GiB cache default, the scratch
    # takes what the cache leaves
    plan = plan_memory(model_bytes=0, sequence_bytes=0, meminfo=board(4 + 1, 4 + 1),
                       cache_bytes=None, prefill_scratch_bytes=None,
                       default_cache_bytes=2 * GIB, default_prefill_scratch_bytes=8 * GIB)
    assert plan.spare_bytes == 4 * GIB
    assert (plan.cache_bytes, plan.prefill_scratch_bytes) == (2 * GIB, 2 * GIB)
    small = plan_memory(model_bytes=0, sequence_bytes=0, meminfo=board(4 + 1, 4 + 1),
                        cache_bytes=None, prefill_scratch_bytes=None,
                        default_cache_bytes=GIB // 2, default_prefill_scratch_bytes=8 * GIB)
    assert (small.cache_bytes, small.prefill_scratch_bytes) == (GIB // 2, 4 * GIB - GIB // 2)


def test_operator_values_stand_and_the_other_gets_the_rest() -> None:
    plan = plan_memory(model_bytes=0, sequence_bytes=0, meminfo=board(4, 4),
                       cache_bytes=GIB, prefill_scratch_bytes=None, **DEFAULTS)
    assert (plan.cache_bytes, plan.prefill_scratch_bytes) == (GIB, 2 * GIB)
    assert plan.auto == ("prefill scratch",)
    plan = plan_memory(model_bytes=0, sequence_bytes=0, meminfo=board(4, 4),
                       cache_bytes=None, prefill_scratch_bytes=0, **DEFAULTS)
    assert (plan.cache_bytes, plan.prefill_scratch_bytes) == (2 * GIB, 0)


def test_operator_values_beyond_the_machine_are_kept_and_flagged() -> None:
    plan = plan_memory(model_bytes=int(5.9 * GIB), sequence_bytes=0, meminfo=board(7.7, 2.0),
                       cache_bytes=4 * GIB, prefill_scratch_bytes=None, **DEFAULTS)
    assert plan.cache_bytes == 4 * GIB and plan.prefill_scratch_bytes == 0
    assert plan.over_by == 4 * GIB - plan.spare_bytes > 0
    assert "exceed this machine's spare memory" in plan.warnings()[0]


def test_an_explicit_zero_cache_leaves_everything_to_the_scratch() -> None:
    plan = plan_memory(model_bytes=0, sequence_bytes=0, meminfo=board(4, 4), cache_bytes=0,
                       prefill_scratch_bytes=None, **DEFAULTS)
    assert (plan.cache_bytes, plan.prefill_scratch_bytes) == (0, 2 * GIB)
    assert plan.warnings() == []  # no sequence to keep: nothing to flag


def test_no_spare_memory_means_no_cache_and_no_scratch() -> None:
    plan = plan_memory(model_bytes=int(7.5 * GIB), sequence_bytes=0, meminfo=board(7.7, 0.5),
                       cache_bytes=None, prefill_scratch_bytes=None, **DEFAULTS)
    assert (plan.spare_bytes, plan.cache_bytes, plan.prefill_scratch_bytes) == (0, 0, 0)


# Ling-3.0-tiny at full size: the bundle's other files, the routed experts' int8 copy (23
# layers x 128 experts x (1536 x 1024 + 512 x 1536 int8 + 4 x (1024 + 1536) of scales), one
# 32K sequence
FULL_MODEL, FULL_COPY, FULL_SEQUENCE = int(5.33 * GIB), 23 * 128 * 2_369_536, int(0.44 * GIB)
# (MemTotal, MemAvailable before loading) of each CM3588 size, GiB
BOARDS = {4: (3.8, 3.5), 8: (7.7, 7.2), 16: (15.6, 15.0), 32: (31.3, 30.5)}


@pytest.mark.parametrize("size,taken,cache_gib", [
    (4, False, 0.0), (8, False, 0.44), (16, True, 0.88), (32, True, 2.0)])
def test_the_int8_expert_copy_per_board_size(size, taken, cache_gib) -> None:
    """16 and 32 GB boards load the copy (~6.5 GiB); 4 and 8 GB keep the CPU experts."""
    total, available = BOARDS[size]
    choice = choose_npu_experts(copy_bytes=FULL_COPY, model_bytes=FULL_MODEL,
                                sequence_bytes=FULL_SEQUENCE, meminfo=board(total, available))
    assert choice.taken is taken, choice.reason
    model = FULL_MODEL + (FULL_COPY if taken else 0)
    after = board(total, max(0.0, available - model / GIB))
    plan = plan_memory(model_bytes=model, sequence_bytes=FULL_SEQUENCE, meminfo=after,
                       cache_bytes=None, prefill_scratch_bytes=None, npu_experts=choice,
                       **DEFAULTS)
    # what the copy leaves the cache (the scratch gets as much): the plan's report
    assert plan.cache_bytes / GIB == pytest.approx(cache_gib, abs=0.02)
    assert f"int8 copy {FULL_COPY / GIB:.2f} GiB {'loaded' if taken else 'not loaded'}" in \
        plan.describe()
    if taken:  # the cache still keeps a snapshot at the context limit
        assert plan.cache_bytes >= FULL_SEQUENCE and not plan.warnings()


def test_the_int8_expert_copy_forced_absent_or_unknown_memory() -> None:
    kw = dict(model_bytes=FULL_MODEL, sequence_bytes=FULL_SEQUENCE, meminfo=board(7.7, 7.2))
    assert choose_npu_experts(copy_bytes=FULL_COPY, force=True, **kw).taken
    assert not choose_npu_experts(copy_bytes=FULL_COPY, force=False,
                                  **{**kw, "meminfo": board(31.3, 30.5)}).taken
    none = choose_npu_experts(copy_bytes=0, force=True, **kw)
    assert not none.taken and "no int8 copy" in none.reason
    assert "none in the bundle" in none.describe()
    # room for the copy but only one more sequence beside it: the cache and the scratch
    # need two, so it stays off; with two it is taken
    edge = (FULL_MODEL + FULL_COPY + FULL_SEQUENCE + RUNTIME_RESERVE) / GIB
    one, two = (board(edge + n * FULL_SEQUENCE / GIB, 99) for n in (1, 2.01))
    assert not choose_npu_experts(copy_bytes=FULL_COPY, **{**kw, "meminfo": one}).taken
    assert choose_npu_experts(copy_bytes=FULL_COPY, **{**kw, "meminfo": two}).taken
    blind = choose_npu_experts(copy_bytes=FULL_COPY, **{**kw, "meminfo": None})
    assert not blind.taken and "not readable" in blind.reason


def test_without_meminfo_the_defaults_stand() -> None:
    plan = plan_memory(model_bytes=GIB, sequence_bytes=0, meminfo=None, cache_bytes=None,
                       prefill_scratch_bytes=GIB // 4, **DEFAULTS)
    assert (plan.cache_bytes, plan.prefill_scratch_bytes) == (2 * GIB, GIB // 4)
    assert plan.spare_bytes is None and "not readable" in plan.describe()


@pytest.fixture(scope="module")
def demo_engine_parts():
    from ling3_rknn.model import Model

    bundle = Bundle.open(demo.bundle_dir(), verify="size")
    return bundle, Model.from_bundle(bundle, verify="none", threads=1)


def test_the_plan_counts_the_bundle_files_and_one_sequence(demo_engine_parts) -> None:
    bundle, model = demo_engine_parts
    plan = loading.memory_plan_for(model, LoadOptions(), 4096, meminfo=board(8, 8))
    # on a host the mock runs the ONNX twins: the .rknn files stay on disk
    assert not model.npu_graphs
    assert plan.model_bytes == sum(p.stat().st_size for p in bundle.root.rglob("*")
                                   if p.is_file() and p.suffix != ".rknn"
                                   and p.name not in ("manifest.json", ".verified.json"))
    twins = {bundle.path(s.onnx) for s in bundle.manifest.stages.values()}
    assert bundle.loaded_bytes(npu_graphs=True) == sum(
        p.stat().st_size for p in bundle.root.rglob("*")
        if p.is_file() and p not in twins and p.name not in ("manifest.json", ".verified.json"))
    state = model.new_state()
    rows = 4096 * model.config.latent_dim * 4 * len(state.latents)
    kda = sum(r.body.nbytes + r.scale.nbytes for r in state.recurrent.values())
    kda += sum(c.nbytes for c in state.conv.values())
    assert plan.sequence_bytes == rows + kda


def test_serving_applies_the_plan(demo_engine_parts, monkeypatch, caplog) -> None:
    """make_engine hands the planned sizes to the engine and the model, and logs them."""
    _, model = demo_engine_parts
    from ling3_rknn.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(model.bundle.path(model.bundle.manifest.tokenizer))
    tiny = {"MemTotal": 3 * GIB, "MemAvailable": 3 * GIB}  # 2 GiB spare after the reserve
    monkeypatch.setattr(loading, "machine_memory", lambda: dict(tiny))
    built = {}

    class Recorded:  # stands in for Engine: the options it would get
        def __init__(self, model, tokenizer, options):
            built["options"] = options
            self.memory_plan = None

    import ling3_rknn.engine

    monkeypatch.setattr(ling3_rknn.engine, "Engine", Recorded)
    before = model.prefill_scratch_bytes
    try:
        with caplog.at_level(logging.INFO, logger="ling3_rknn.loading"):
            engine = loading.make_engine(model, tokenizer, LoadOptions(max_context=2048))
        plan = loading.memory_plan_for(model, LoadOptions(), 2048, meminfo=tiny)
        assert plan.cache_bytes + plan.prefill_scratch_bytes == plan.spare_bytes < 2 * GIB
        assert engine.memory_plan == plan
        assert built["options"].cache_bytes == plan.cache_bytes
        # the disk tier holds no memory: it keeps the default budget
        assert built["options"].cache_disk_bytes == 4 * 2 * GIB
        assert model.prefill_scratch_bytes == plan.prefill_scratch_bytes
        assert any("prefix cache" in r.getMessage() and "sized here" in r.getMessage()
                   for r in caplog.records)
    finally:
        model.prefill_scratch_bytes = before


def _cgroup_files(tmp_path: Path, line: str, files: dict[str, str]) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(line + "\n")
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return cgroup, tmp_path / "fs"


def test_a_cgroup_v2_limit_caps_the_machine(tmp_path: Path) -> None:
    cgroup, root = _cgroup_files(tmp_path, "0::/system.slice/ling3-rknn.service", {
        "system.slice/ling3-rknn.service/memory.max": str(6 * GIB),
        "system.slice/ling3-rknn.service/memory.current": str(GIB)})
    assert cgroup_memory(cgroup, root) == (6 * GIB, GIB)


def test_a_cgroup_v1_limit_inside_a_container_namespace(tmp_path: Path) -> None:
    # the namespaced path does not exist below the mount: the limit sits at its root
    cgroup, root = _cgroup_files(tmp_path, "4:memory:/docker/abc", {
        "memory/memory.limit_in_bytes": str(8 * GIB),
        "memory/memory.usage_in_bytes": str(2 * GIB)})
    assert cgroup_memory(cgroup, root) == (8 * GIB, 2 * GIB)


def test_no_cgroup_limit_is_none(tmp_path: Path) -> None:
    cgroup, root = _cgroup_files(tmp_path, "0::/user.slice", {
        "user.slice/memory.max": "max", "user.slice/memory.current": str(GIB)})
    assert cgroup_memory(cgroup, root) is None
    unlimited_v1, root_v1 = _cgroup_files(tmp_path / "v1", "4:memory:/", {
        "memory/memory.limit_in_bytes": str(9223372036854771712),
        "memory/memory.usage_in_bytes": str(GIB)})
    assert cgroup_memory(unlimited_v1, root_v1) is None
    assert cgroup_memory(tmp_path / "missing", root) is None


def test_the_machine_figures_take_the_cgroup_limit(monkeypatch) -> None:
    import ling3_rknn.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "read_meminfo", lambda path=None: board(32, 30))
    monkeypatch.setattr(memory_plan, "cgroup_memory", lambda: (8 * GIB, 3 * GIB))
    assert memory_plan.machine_memory() == {"MemTotal": 8 * GIB, "MemAvailable": 5 * GIB}
    monkeypatch.setattr(memory_plan, "cgroup_memory", lambda: None)
    assert memory_plan.machine_memory() == board(32, 30)


def test_the_npu_attention_rows_come_before_the_caches_half() -> None:
    """A 16 GB board beside the int8 expert copy: 1.75 GiB to share. Halves would leave the
    scratch 0.88 GiB, under the 1.13 GB of NPU rows opencode's 16.6K first request needs (9
    pieces of 2048 rows x 61,440 bytes), and the prompt would fall back to the CPU; the rows
    first keep one snapshot for the cache and give the scratch the rest."""
    spare = int(1.75 * GIB)
    seq = int(0.44 * GIB)
    rows_32k = 16 * 2048 * 61440
    common = dict(model_bytes=0, sequence_bytes=seq, meminfo=board(
        (spare + seq + RUNTIME_RESERVE) / GIB, (spare + seq + RUNTIME_RESERVE) / GIB),
        cache_bytes=None, prefill_scratch_bytes=None, **DEFAULTS)
    halves = plan_memory(**common)
    first = plan_memory(**common, scratch_first_bytes=rows_32k)
    assert halves.prefill_scratch_bytes < 9 * 2048 * 61440
    assert first.cache_bytes == seq  # one full-context snapshot still fits
    assert first.prefill_scratch_bytes == first.spare_bytes - seq >= 9 * 2048 * 61440
    roomy = plan_memory(**{**common, "meminfo": board(15.6, 9.0)}, scratch_first_bytes=rows_32k)
    assert (roomy.cache_bytes, roomy.prefill_scratch_bytes) == (2 * GIB, 2 * GIB)

"""The CPU thread policy: core choice on big.LITTLE, thread counts, and what apply() sets."""

from __future__ import annotations

import os

import pytest
from threadpoolctl import threadpool_info

from ling3_rknn import cpu_threads
from ling3_rknn.cpu_threads import ThreadPolicy, ThreadPolicyError, biggest_cores, is_rk3588


def fake_sysfs(tmp_path, capacities):
    for cpu, cap in enumerate(capacities):
        d = tmp_path / f"cpu{cpu}"
        d.mkdir()
        if cap is not None:
            (d / "cpu_capacity").write_text(f"{cap}\n")
    return tmp_path


def test_rk3588_compute_runs_on_the_a76_cores_only(tmp_path):
    sysfs = fake_sysfs(tmp_path, [414] * 4 + [1024] * 4)
    assert biggest_cores(list(range(8)), sysfs) == [4, 5, 6, 7]
    policy = ThreadPolicy.resolve(cpus=list(range(8)), sys_cpu=sysfs)
    assert policy == ThreadPolicy(4, (4, 5, 6, 7))
    # a process confined to some cores (taskset, CPUAffinity=) keeps within them
    assert ThreadPolicy.resolve(cpus=[0, 1, 6], sys_cpu=sysfs) == ThreadPolicy(1, (6,))


def test_without_capacities_every_allowed_core_counts(tmp_path):
    sysfs = fake_sysfs(tmp_path, [None, None])
    assert biggest_cores([0, 1], sysfs) == [0, 1]
    assert ThreadPolicy.resolve(cpus=[0, 1], sys_cpu=sysfs).threads == 2
    many = list(range(16))
    assert ThreadPolicy.resolve(cpus=many, sys_cpu=tmp_path / "none").threads == 4
    assert ThreadPolicy.resolve(3, cpus=many, sys_cpu=tmp_path / "none").threads == 3


@pytest.mark.parametrize("threads", [0, -1, True, 2.0])
def test_bad_thread_counts_are_refused(tmp_path, threads):
    with pytest.raises(ThreadPolicyError, match="positive integer"):
        ThreadPolicy.resolve(threads, cpus=[0, 1], sys_cpu=tmp_path)


def test_more_threads_than_compute_cores_is_refused(tmp_path):
    sysfs = fake_sysfs(tmp_path, [414] * 4 + [1024] * 4)
    with pytest.raises(ThreadPolicyError, match=r"more than the 4 cores .*cpu4,5,6,7"):
        ThreadPolicy.resolve(5, cpus=list(range(8)), sys_cpu=sysfs)


def test_rk3588_is_recognised_from_the_device_tree(tmp_path):
    dt = tmp_path / "compatible"
    dt.write_bytes(b"friendlyelec,cm3588-nas\x00rockchip,rk3588\x00")
    assert is_rk3588(dt)
    dt.write_bytes(b"raspberrypi,5-model-b\x00brcm,bcm2712\x00")
    assert not is_rk3588(dt)
    assert not is_rk3588(tmp_path / "missing")


def test_apply_pins_every_thread_and_holds_blas_to_one(monkeypatch):
    import numpy as np  # noqa: F401 - BLAS must be loaded for threadpoolctl to see it

    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_threads, "_applied", None)
    policy = cpu_threads.apply_thread_policy(len(allowed))
    assert policy.cpus == tuple(allowed)
    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    assert blas and all(p["num_threads"] == 1 for p in blas)
    for tid in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(tid)) == set(allowed)
    # idempotent: no count or the same count returns the policy in force
    assert cpu_threads.apply_thread_policy() is policy
    assert cpu_threads.apply_thread_policy(len(allowed)) is policy


def test_bundle_pools_take_the_policy_thread_count():
    from ling3_rknn.demo import bundle_dir
    from ling3_rknn.model import Model

    threads = min(2, len(os.sched_getaffinity(0)))
    model = Model.from_bundle(bundle_dir(), verify="size", threads=threads)
    assert model.threads == threads
    experts = model.experts._cpu  # type: ignore[attr-defined]
    assert experts
    for ex in experts.values():
        assert ex._session.get_session_options().intra_op_num_threads == threads
    cores = cpu_threads.pool_worker_cores(threads)
    for ex in experts.values():
        opts = ex._session.get_session_options()
        if cores:
            assert opts.get_session_config_entry("session.intra_op_thread_affinities") == \
                ";".join(str(c + 1) for c in cores)


def test_pool_workers_get_one_core_each_after_the_first(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_applied", ThreadPolicy(4, (4, 5, 6, 7)))
    assert cpu_threads.pool_worker_cores(4) == (5, 6, 7)  # the caller is the 4th thread
    assert cpu_threads.pool_worker_cores(2) == (5,)
    assert cpu_threads.pool_worker_cores(1) == ()
    assert cpu_threads.pool_worker_cores(6) == (5, 6, 7, 5, 6)  # never more than asked
    monkeypatch.setattr(cpu_threads, "_applied", ThreadPolicy(1, (3,)))
    assert cpu_threads.pool_worker_cores(2) == ()  # one core: nothing to choose
    monkeypatch.setattr(cpu_threads, "_applied", None)
    assert cpu_threads.pool_worker_cores(4) == ()  # no policy: the scheduler decides


def test_session_options_pin_workers_with_onnxruntime_numbering(monkeypatch):
    from ling3_rknn.npu.executors import cpu_session_options

    monkeypatch.setattr(cpu_threads, "_applied", ThreadPolicy(4, (4, 5, 6, 7)))
    opts = cpu_session_options(3)
    assert opts.intra_op_num_threads == 3 and opts.inter_op_num_threads == 1
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    # onnxruntime numbers logical processors from 1: cpu5 and cpu6 are "6" and "7"
    assert opts.get_session_config_entry("session.intra_op_thread_affinities") == "6;7"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        cpu_session_options(1).get_session_config_entry("session.intra_op_thread_affinities")

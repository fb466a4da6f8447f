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

"""DevicePool: disjoint leases across real processes, stale-lease reclaim, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from convergence.launch.pool import (
    NODE_GPUS_ENV,
    RANKS_PER_GPU_ENV,
    DevicePool,
    PoolTooSmall,
    default_cpu_slots,
    detect_devices,
    placement_problem,
    ranks_per_gpu,
)
from convergence.launch.step_gpus import narrowed

WORKER = Path(__file__).parent / "fixtures" / "fake_trainers" / "pool_worker.py"


def test_leases_are_disjoint_and_released(tmp_path: Path) -> None:
    pool = DevicePool(tmp_path, 4, "gpu")
    with pool.lease(2) as a, pool.lease(2) as b:
        assert set(a.devices).isdisjoint(b.devices)
        assert set(a.devices) | set(b.devices) == {"0", "1", "2", "3"}
        assert a.env == {"CUDA_VISIBLE_DEVICES": ",".join(a.devices)}
        assert len(pool.holders()) == 4
    assert pool.holders() == {}


def test_cpu_lease_is_accounting_only(tmp_path: Path) -> None:
    with DevicePool(tmp_path, 8, "cpu").lease(3) as lease:
        assert len(lease.devices) == 3 and lease.env == {}


def test_asking_more_than_the_pool_fails_naming_counts_and_fix(tmp_path: Path) -> None:
    pool = DevicePool(tmp_path, 2, "cpu")
    with pytest.raises(
        PoolTooSmall,
        match=r"needs 4 CPU slots but the device pool has 2.*"
        r"--convergence-devices",
    ):
        with pool.lease(4):
            pass


def test_waiting_lease_times_out_with_holders(tmp_path: Path) -> None:
    pool = DevicePool(tmp_path, 2, "cpu", poll_s=0.01)
    with pool.lease(2):
        with pytest.raises(TimeoutError, match="waited 0.2 s for 1 free cpu"):
            with pool.lease(1, timeout=0.2):
                pass


def test_lease_blocks_until_devices_are_freed(tmp_path: Path) -> None:
    pool = DevicePool(tmp_path, 2, "cpu", poll_s=0.01)
    got: list[float] = []

    def waiter() -> None:
        with pool.lease(2, timeout=10):
            got.append(time.monotonic())

    with pool.lease(1):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        assert got == []  # still blocked: only 1 of 2 free
        released = time.monotonic()
    t.join(10)
    assert got and got[0] >= released


def test_stale_lease_of_a_dead_pid_is_reclaimed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pool = DevicePool(tmp_path, 2, "gpu")
    pool.state_path.write_text(
        json.dumps({"0": {"pid": dead.pid, "lease": "x"}, "1": {"pid": dead.pid, "lease": "x"}})
    )
    with pool.lease(2, timeout=1) as lease:
        assert lease.devices == ("0", "1")


def test_two_processes_never_double_lease(tmp_path: Path) -> None:
    log = tmp_path / "leases.log"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path / "state"), "3", "2", "6", str(log)]
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len(rows) == 12 and len({r[0] for r in rows}) == 2
    # 3 devices, leases of 2: any two overlapping intervals would share a device.
    spans = [(float(s), float(e), set(d.split(","))) for _, s, e, d in rows]
    for i, (s1, e1, d1) in enumerate(spans):
        for s2, e2, d2 in spans[i + 1 :]:
            overlap = s1 < e2 and s2 < e1
            assert not (overlap and d1 & d2), (s1, e1, d1, s2, e2, d2)


def test_detect_devices_on_this_machine(tmp_path: Path) -> None:
    found = detect_devices(cpu_slots=5)
    if found.kind == "cpu":
        assert found.devices == ("0", "1", "2", "3", "4")
    assert default_cpu_slots() >= 8


# -- a pool of nodes (a Slurm allocation: convergence.launch.devices) -----------------------


def _node_pool(
    tmp_path: Path, nodes: int = 2, per_node: int = 4, cap: int | None = None
) -> DevicePool:
    devices = [f"n{k}:{i}" for k in range(1, nodes + 1) for i in range(per_node)][:cap]
    return DevicePool(tmp_path, devices, "gpu", per_node=per_node, where="allocation 7")


def test_small_jobs_take_slices_of_one_node_and_leave_whole_nodes_free(tmp_path: Path) -> None:
    pool = _node_pool(tmp_path)
    with pool.lease(2) as a, pool.lease(1) as b:
        # Best fit: the second job goes on the node the first one started, not on n2.
        assert a.hosts == b.hosts == ("n1",)
        assert a.env == {NODE_GPUS_ENV: "0,1"} and b.env == {NODE_GPUS_ENV: "2"}
        with pool.lease(4, timeout=1) as whole:  # n2 is still whole
            assert whole.hosts == ("n2",) and whole.env == {NODE_GPUS_ENV: "0,1,2,3"}
        with pytest.raises(TimeoutError):
            with pool.lease(8, timeout=0.2):  # needs both nodes whole: waits
                pass
    with pool.lease(8, timeout=1) as both:
        assert both.hosts == ("n1", "n2") and both.env == {}  # whole nodes: the step's own GPUs


def test_jobs_that_cannot_be_placed_are_refused_with_the_reason(tmp_path: Path) -> None:
    pool = _node_pool(tmp_path)
    with pytest.raises(PoolTooSmall, match="needs 12 GPUs, allocation 7 has 8"):
        with pool.lease(12):
            pass
    with pytest.raises(PoolTooSmall, match="not whole nodes.*multiple of 4"):
        with pool.lease(6):
            pass
    capped = _node_pool(tmp_path / "capped", cap=6)  # --convergence-devices 6
    assert capped.size == 6
    with pytest.raises(PoolTooSmall, match="needs 8 GPUs, allocation 7 has 6"):
        with capped.lease(8):
            pass
    with capped.lease(4, timeout=1) as whole, capped.lease(2, timeout=1) as rest:
        assert whole.hosts == ("n1",) and rest.devices == ("n2:0", "n2:1")
    assert "needs 2 whole nodes of 4 GPUs" in str(
        placement_problem(("a:0", "a:1", "a:2", "a:3", "b:0", "b:1", "c:0", "c:1"), 4, "gpu", 8)
    )
    assert placement_problem(("a:0", "a:1", "b:0", "b:1"), 2, "cpu", 4) is None
    assert "needs 5 CPU slots" in str(placement_problem(("0", "1"), None, "cpu", 5))


def test_detect_devices_cap_applies_on_gpu_hosts_too() -> None:
    # The cap is a plain truncation whatever the kind (here: CPU slots; on a GPU host the
    # visible GPUs are truncated the same way, see detect_devices).
    assert len(detect_devices(3).devices) == 3


def test_step_narrows_slurms_visible_devices() -> None:
    # Slurm writes the step's GPUs into CUDA_VISIBLE_DEVICES itself: the lease's indices on
    # the node pick positions in that list.
    assert narrowed("1,2", "4,5,6,7") == "5,6"
    assert narrowed("0", None) == "0"
    with pytest.raises(SystemExit, match="sees only"):
        narrowed("3", "0,1")


def test_ranks_sharing_a_gpu_see_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CONVERGENCE_RANKS_PER_GPU=4 on a one-GPU machine: a 4-rank job leases the GPU's four
    rank slots and is shown the one GPU (its trainer then talks through gloo: NCCL refuses two
    ranks on one GPU). Run for real on an H200 (BENCHMARKS.md "GPU checks")."""
    pool = DevicePool(tmp_path, ["0", "0/1", "0/2", "0/3"], kind="gpu")
    with pool.lease(4) as lease:
        assert lease.env == {"CUDA_VISIBLE_DEVICES": "0"}
    with pool.lease(2) as a, pool.lease(2) as b:
        assert {a.env["CUDA_VISIBLE_DEVICES"], b.env["CUDA_VISIBLE_DEVICES"]} == {"0"}
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "4")
    assert ranks_per_gpu() == 4
    for bad in ("0", "two"):
        monkeypatch.setenv(RANKS_PER_GPU_ENV, bad)
        with pytest.raises(ValueError, match=RANKS_PER_GPU_ENV):
            ranks_per_gpu()

"""DevicePool: disjoint leases across real processes, stale-lease reclaim, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from convergence.launch.pool import DevicePool, PoolTooSmall, default_cpu_slots, detect_devices

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
    with pytest.raises(PoolTooSmall, match=r"needs 4 CPU slots but the device pool has 2.*"
                                           r"--convergence-devices"):
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
    pool.state_path.write_text(json.dumps({"0": {"pid": dead.pid, "lease": "x"},
                                           "1": {"pid": dead.pid, "lease": "x"}}))
    with pool.lease(2, timeout=1) as lease:
        assert lease.devices == ("0", "1")


def test_two_processes_never_double_lease(tmp_path: Path) -> None:
    log = tmp_path / "leases.log"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "state"), "3", "2",
                               "6", str(log)]) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len(rows) == 12 and len({r[0] for r in rows}) == 2
    # 3 devices, leases of 2: any two overlapping intervals would share a device.
    spans = [(float(s), float(e), set(d.split(","))) for _, s, e, d in rows]
    for i, (s1, e1, d1) in enumerate(spans):
        for s2, e2, d2 in spans[i + 1:]:
            overlap = s1 < e2 and s2 < e1
            assert not (overlap and d1 & d2), (s1, e1, d1, s2, e2, d2)


def test_detect_devices_on_this_machine(tmp_path: Path) -> None:
    found = detect_devices(cpu_slots=5)
    if found.kind == "cpu":
        assert found.devices == ("0", "1", "2", "3", "4")
    assert default_cpu_slots() >= 8

"""Leasing devices to jobs, safely across processes (pytest-xdist workers share one pool).

The pool is a JSON state file ``{device: {"pid": owner pid, "lease": lease id}}`` guarded by a
file lock. A lease whose owner pid is dead is reclaimed, so a crashed worker never holds devices
forever.

GPUs: a lease of N devices gives the job ``CUDA_VISIBLE_DEVICES``.
CPU: devices are *slots* and pure accounting: a job of N ranks takes N slots, which bounds how
many ranks all concurrent jobs start together. Default slot count: ``max(os.cpu_count(), 8)``.
Why not ``os.cpu_count()``: gloo ranks oversubscribe fine (slowly), and the common 2-core
machine must still be able to run a 4- or 8-rank layout (dp2 x tp2 x pp2); 8 slots keep at most
8 ranks alive at once, which bounds the slowdown and the memory (each rank ~300 MB of torch).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from convergence.launch.process_tree import pid_alive
from convergence.torch_info import may_see_gpus

KINDS = ("gpu", "cpu")
MIN_CPU_SLOTS = 8


@dataclass(frozen=True, kw_only=True)
class DeviceSet:
    """What this machine offers: ``kind`` and the device names."""

    kind: str
    devices: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Devices held by one job until the ``with`` block ends."""

    kind: str
    devices: tuple[str, ...]
    lease_id: str = field(repr=False)

    @property
    def env(self) -> dict[str, str]:
        """Environment for the job: ``CUDA_VISIBLE_DEVICES`` for GPUs, nothing for CPU slots."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices)} if self.kind == "gpu" else {}


def default_cpu_slots() -> int:
    return max(os.cpu_count() or 1, MIN_CPU_SLOTS)


def detect_devices(cpu_slots: int | None = None) -> DeviceSet:
    """GPUs if torch sees any, else ``cpu_slots`` (default :func:`default_cpu_slots`) slots.

    torch is imported only when it may see a GPU: a CPU-only build or CUDA_VISIBLE_DEVICES
    hiding every GPU is told without it, so the pytest process of a CPU machine never pays
    torch's import (seconds) before its first job.
    """
    if not may_see_gpus():
        count = 0
    else:
        import torch  # lazy: importing torch costs seconds

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count > 0:
        # A lease's CUDA_VISIBLE_DEVICES replaces the parent's, so names must be what the
        # parent saw: with CUDA_VISIBLE_DEVICES=2,3 set, "0" would wrongly mean physical GPU 0.
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                   if d.strip()]
        names = visible[:count] if len(visible) >= count else [str(i) for i in range(count)]
        return DeviceSet(kind="gpu", devices=tuple(names))
    slots = cpu_slots if cpu_slots is not None else default_cpu_slots()
    return DeviceSet(kind="cpu", devices=tuple(str(i) for i in range(slots)))


def _owner(entry: dict[str, object]) -> int:
    pid = entry.get("pid")
    return pid if isinstance(pid, int) else -1


class PoolTooSmall(ValueError):
    """A job asks for more devices than the pool will ever have."""


class DevicePool:
    """A cross-process pool of devices; see the module docstring."""

    def __init__(self, state_dir: Path, devices: Sequence[str] | int, kind: str = "cpu", *,
                 poll_s: float = 0.1) -> None:
        if kind not in KINDS:
            raise ValueError(f"device pool kind must be one of {KINDS}, got {kind!r}")
        self.devices = tuple(str(i) for i in range(devices)) if isinstance(devices, int) \
            else tuple(devices)
        if not self.devices:
            raise ValueError("a device pool needs at least one device")
        self.kind = kind
        self.poll_s = poll_s
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / f"devices-{kind}.json"
        self._lock = filelock.FileLock(str(self.state_dir / f"devices-{kind}.lock"))

    @property
    def size(self) -> int:
        return len(self.devices)

    @contextmanager
    def lease(self, n: int, timeout: float | None = None) -> Iterator[Lease]:
        """Hold ``n`` disjoint devices for the ``with`` block, waiting until they are free.

        Raises :class:`PoolTooSmall` at once if ``n`` exceeds the pool, ``TimeoutError`` if
        ``timeout`` seconds pass first.
        """
        if n < 1:
            raise ValueError(f"a lease needs at least 1 device, got {n}")
        if n > self.size:
            unit = "GPUs" if self.kind == "gpu" else "CPU slots"
            raise PoolTooSmall(
                f"job needs {n} {unit} but the device pool has {self.size}; run fewer ranks or "
                f"raise the pool size (--convergence-devices {n})")
        lease = self._acquire(n, timeout)
        try:
            yield lease
        finally:
            self._release(lease)

    def holders(self) -> dict[str, int]:
        """Current leases: device -> owner pid (live owners only)."""
        with self._lock:
            return {d: _owner(v) for d, v in self._live_state().items()}

    def _acquire(self, n: int, timeout: float | None) -> Lease:
        lease_id = uuid.uuid4().hex
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                state = self._live_state()
                free = [d for d in self.devices if d not in state]
                if len(free) >= n:
                    chosen = tuple(free[:n])
                    for d in chosen:
                        state[d] = {"pid": os.getpid(), "lease": lease_id}
                    self._write(state)
                    return Lease(kind=self.kind, devices=chosen, lease_id=lease_id)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout:g} s for {n} free {self.kind} devices of {self.size}; "
                    f"held: {self.holders()} (device -> pid) in {self.state_path}")
            time.sleep(self.poll_s)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            state = self._live_state()
            kept = {d: v for d, v in state.items() if v.get("lease") != lease.lease_id}
            self._write(kept)

    def _live_state(self) -> dict[str, dict[str, object]]:
        """State without leases of dead owners (call with the lock held)."""
        try:
            raw = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            raw = {}  # no file yet, or a write cut short by a crash: owners re-lease
        if not isinstance(raw, dict):
            return {}
        return {d: v for d, v in raw.items()
                if isinstance(v, dict) and isinstance(v.get("pid"), int) and pid_alive(_owner(v))}

    def _write(self, state: dict[str, dict[str, object]]) -> None:
        tmp = self.state_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self.state_path)

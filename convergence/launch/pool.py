"""Leasing devices to jobs, safely across processes (pytest-xdist workers share one pool).

The pool is a JSON state file ``{device: {"pid": owner pid, "lease": lease id}}`` guarded by a
file lock. A lease whose owner pid is dead is reclaimed, so a crashed worker never holds devices
forever.

GPUs: a lease of N devices gives the job ``CUDA_VISIBLE_DEVICES``.
Nodes (a Slurm allocation, :mod:`convergence.launch.devices`): devices are named
``host:index`` and the pool places a job: W ranks up to one node's devices take a slice of one
node (the fullest node that still fits, so whole nodes stay free for large jobs); a larger job
takes ``W / per_node`` whole free nodes. The lease names its hosts; the launcher runs there.
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

from convergence.launch.cancel import check_cancelled
from convergence.launch.process_tree import pid_alive
from convergence.torch_info import may_see_gpus

KINDS = ("gpu", "cpu")
MIN_CPU_SLOTS = 8
NODE_GPUS_ENV = "CONVERGENCE_NODE_GPUS"
RANKS_PER_GPU_ENV = "CONVERGENCE_RANKS_PER_GPU"
"""Ranks that may share one GPU on one machine (default :data:`DEFAULT_RANKS_PER_GPU`; 1
turns sharing off). Above 1, a GPU is offered as that many slots named ``"<gpu>/<k>"``. A job
of no more ranks than the machine has GPUs leases whole GPUs (every slot of each: one rank per
GPU, NCCL); a larger one leases slots, its ranks share GPUs and talk through gloo (the
trainer's init_distributed: NCCL refuses two ranks on one GPU). Which layouts may share is
decided at collection (convergence.launch.placement): those whose collectives gloo runs on
CUDA tensors; the others run on CPU."""
DEFAULT_RANKS_PER_GPU = 4
"""Enough for the quick start's 4-rank layouts on one GPU; a rank of a small model holds
~0.5 GB of GPU memory (its CUDA context)."""


@dataclass(frozen=True, kw_only=True)
class DeviceSet:
    """What this session offers: ``kind`` and the device names (``host:index`` on nodes)."""

    kind: str
    devices: tuple[str, ...]
    per_node: int | None = None
    """Devices per node of an allocation; None: one machine, no placement."""
    where: str = "this machine"
    """Where the devices are, for messages (e.g. "Slurm allocation 12: 2 nodes x 4 GPUs")."""

    def placement_problem(self, n: int) -> str | None:
        """Why a job of ``n`` ranks can never be placed on these devices; None if it can."""
        return placement_problem(self.devices, self.per_node, self.kind, n, self.where)


def _unit(kind: str) -> str:
    return "GPUs" if kind == "gpu" else "CPU slots"


def node_of(device: str) -> str | None:
    """``"host:3"`` -> ``"host"``; None for a plain device name."""
    host, sep, _ = device.rpartition(":")
    return host if sep else None


def _by_gpu(devices: Sequence[str]) -> dict[str, list[str]]:
    """Slots by GPU: ``["0", "0/1", "1", "1/1"]`` -> ``{"0": ["0", "0/1"], "1": [...]}``."""
    gpus: dict[str, list[str]] = {}
    for d in devices:
        gpus.setdefault(d.partition("/")[0], []).append(d)
    return gpus


def _by_node(devices: Sequence[str]) -> dict[str, list[str]]:
    nodes: dict[str, list[str]] = {}
    for d in devices:
        nodes.setdefault(node_of(d) or "", []).append(d)
    return nodes


def placement_problem(
    devices: Sequence[str], per_node: int | None, kind: str, n: int, where: str = "this machine"
) -> str | None:
    """See :meth:`DeviceSet.placement_problem`."""
    unit = _unit(kind)
    if n > len(devices):
        return f"needs {n} {unit}, {where} has {len(devices)}"
    if per_node is None or n <= per_node:
        return None
    if n % per_node:
        return (
            f"needs {n} {unit}, more than one node's {per_node} but not whole nodes "
            f"({where}); use a multiple of {per_node}"
        )
    whole = sum(1 for members in _by_node(devices).values() if len(members) == per_node)
    if n // per_node > whole:
        return f"needs {n // per_node} whole nodes of {per_node} {unit}, {where} has {whole}"
    return None


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Devices held by one job until the ``with`` block ends."""

    kind: str
    devices: tuple[str, ...]
    lease_id: str = field(repr=False)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The nodes of the lease, in order (empty on one machine)."""
        return tuple(h for h in _by_node(self.devices) if h)

    @property
    def env(self) -> dict[str, str]:
        """Environment for the job: ``CUDA_VISIBLE_DEVICES`` for GPUs on one machine; on a
        node slice, ``CONVERGENCE_NODE_GPUS`` (the indices on that node, which the Slurm step
        maps through the step's own ``CUDA_VISIBLE_DEVICES``: convergence.launch.step_gpus);
        nothing for CPU slots or whole nodes."""
        if self.kind != "gpu":
            return {}
        if not self.hosts:
            # "0/1" is the second rank slot of GPU 0 (RANKS_PER_GPU_ENV): name each GPU once.
            gpus = dict.fromkeys(d.partition("/")[0] for d in self.devices)
            return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        if len(self.hosts) > 1:
            return {}
        return {NODE_GPUS_ENV: ",".join(d.rpartition(":")[2] for d in self.devices)}


def default_cpu_slots() -> int:
    return max(os.cpu_count() or 1, MIN_CPU_SLOTS)


def detect_devices(cpu_slots: int | None = None) -> DeviceSet:
    """GPUs if torch sees any (at most ``cpu_slots`` of them: --convergence-devices caps the
    pool on GPU hosts too), else ``cpu_slots`` (default :func:`default_cpu_slots`) slots.

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
        visible = [
            d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()
        ]
        names = visible[:count] if len(visible) >= count else [str(i) for i in range(count)]
        share = ranks_per_gpu()
        if share > 1:
            names = [f"{n}/{k}" if k else n for n in names for k in range(share)]
        return DeviceSet(kind="gpu", devices=tuple(names[:cpu_slots] if cpu_slots else names))
    slots = cpu_slots if cpu_slots is not None else default_cpu_slots()
    return DeviceSet(kind="cpu", devices=tuple(str(i) for i in range(slots)))


def ranks_per_gpu() -> int:
    """:data:`RANKS_PER_GPU_ENV` as a number (:data:`DEFAULT_RANKS_PER_GPU` when unset)."""
    raw = os.environ.get(RANKS_PER_GPU_ENV, str(DEFAULT_RANKS_PER_GPU))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{RANKS_PER_GPU_ENV}={raw!r}: use a whole number of at least 1")
    return value


def _owner(entry: dict[str, object]) -> int:
    pid = entry.get("pid")
    return pid if isinstance(pid, int) else -1


class PoolTooSmall(ValueError):
    """A job asks for more devices than the pool will ever have."""


class DevicePool:
    """A cross-process pool of devices; see the module docstring."""

    def __init__(
        self,
        state_dir: Path,
        devices: Sequence[str] | int,
        kind: str = "cpu",
        *,
        poll_s: float = 0.1,
        per_node: int | None = None,
        where: str = "the device pool",
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"device pool kind must be one of {KINDS}, got {kind!r}")
        self.devices = (
            tuple(str(i) for i in range(devices)) if isinstance(devices, int) else tuple(devices)
        )
        if not self.devices:
            raise ValueError("a device pool needs at least one device")
        self.kind = kind
        self.per_node = per_node
        self.where = where
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
        if n > self.size and self.per_node is None:
            raise PoolTooSmall(
                f"job needs {n} {_unit(self.kind)} but the device pool has {self.size}; run "
                f"fewer ranks or raise the pool size (--convergence-devices {n})"
            )
        problem = placement_problem(self.devices, self.per_node, self.kind, n, self.where)
        if problem:
            raise PoolTooSmall(f"job {problem}")
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
                chosen = self._place(free, n)
                if chosen:
                    for d in chosen:
                        state[d] = {"pid": os.getpid(), "lease": lease_id}
                    self._write(state)
                    return Lease(kind=self.kind, devices=chosen, lease_id=lease_id)
            check_cancelled(f"waiting for {n} {self.kind} devices")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout:g} s for {n} free {self.kind} devices of {self.size}; "
                    f"held: {self.holders()} (device -> pid) in {self.state_path}"
                )
            time.sleep(self.poll_s)

    def _place(self, free: list[str], n: int) -> tuple[str, ...]:
        """``n`` free devices for one job (see the module docstring), or () if not now."""
        if self.per_node is None:
            gpus = _by_gpu(self.devices)
            if self.kind == "gpu" and len(gpus) < len(self.devices) and n <= len(gpus):
                # Slots of shared GPUs, but the job fits one GPU per rank: whole GPUs (NCCL).
                whole = [slots for slots in gpus.values() if all(s in free for s in slots)]
                return tuple(s for slots in whole[:n] for s in slots) if len(whole) >= n else ()
            if self.kind == "gpu":  # ranks sharing GPUs: spread them, first slots first
                free = sorted(free, key=lambda d: int(d.partition("/")[2] or 0))
            return tuple(free[:n]) if len(free) >= n else ()
        nodes = _by_node(free)
        if n <= self.per_node:
            fits = [members for members in nodes.values() if len(members) >= n]
            return tuple(min(fits, key=len)[:n]) if fits else ()
        whole = [members for members in nodes.values() if len(members) == self.per_node]
        needed = n // self.per_node
        return (
            tuple(d for members in whole[:needed] for d in members) if len(whole) >= needed else ()
        )

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
        return {
            d: v
            for d, v in raw.items()
            if isinstance(v, dict) and isinstance(v.get("pid"), int) and pid_alive(_owner(v))
        }

    def _write(self, state: dict[str, dict[str, object]]) -> None:
        tmp = self.state_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self.state_path)

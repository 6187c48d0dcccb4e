"""Where a pair runs, decided at collection for all of its jobs alike.

On a machine with GPUs a job whose ranks fit the GPUs gets one GPU per rank (NCCL). A larger job
has three ways to run, tried in this order (``--convergence-device auto``):

    shared GPU   its ranks share the GPUs (the pool's GPU slots, pool.py), talking through gloo,
                 when every collective its layout calls runs on CUDA tensors over gloo
                 (:data:`GLOO_ON_CUDA`, measured by benchmarks/gloo_cuda_probe.py)
    CPU          on CPU slots (gloo), for the built-in trainer (its device follows what the job
                 sees: the CPU pool's lease hides the GPUs)
    skip         with the reason and the fixes that exist (a larger machine, another device)

One decision per pair, from its largest job and the union of its layouts' needs, so the control
and the test always run on the same kind of device: a GPU control against a CPU test is not a
comparison. ``--convergence-device cpu`` puts every built-in pair on CPU; ``cuda`` never falls
back to CPU (skips instead). A CPU-only machine runs everything on CPU (``cuda`` skips there,
naming why).

A job placed on CPU carries ``device = "cpu"`` (convergence.spec.job.JobSpec): part of its
run-cache key, so a cached GPU control is never compared with a CPU test, and the job level
leases its ranks from the CPU slots (convergence.run.jobs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from convergence.launch.pool import DeviceSet, default_cpu_slots
from convergence.spec.job import JobSpec
from convergence.spec.layout import Layout

DEVICE_MODES = ("auto", "cuda", "cpu")

#: Which collectives gloo runs on CUDA tensors (ranks sharing a GPU). Measured on an H200 with
#: torch 2.11 (BENCHMARKS.md "GPU checks"; benchmarks/gloo_cuda_probe.py writes the full table,
#: README "Ranks sharing a GPU"): the classic collectives stage through host memory and run;
#: point-to-point sends hand gloo the CUDA pointer (``writev ... Bad address``, SIGABRT in
#: torch.distributed.pipelining); DTensor's functional collectives crashed (SIGSEGV).
GLOO_ON_CUDA: dict[str, bool] = {
    "all_reduce": True,
    "reduce_scatter": True,
    "all_gather": True,
    "send_recv": False,
    "functional": False,
}


def layout_collectives(layout: Layout) -> dict[str, str]:
    """The collectives a layout's job calls, each with the axis that needs it (for reasons)."""
    needs: dict[str, str] = {}
    if layout.dp_shard > 1 or layout.cp > 1:  # FSDP's all-gather / reduce-scatter
        needs.update(all_gather="FSDP", reduce_scatter="FSDP")
    if layout.dp_replicate > 1 or layout.cp > 1:
        needs["all_reduce"] = "DDP/HSDP"
    if layout.cp > 1:
        # CP's ring exchange of the sequence shards runs on all-gathers of the classic API.
        needs.setdefault("all_gather", "CP")
    if layout.tp > 1:
        needs["functional"] = "TP (DTensor's functional collectives)"
    if layout.pp > 1:
        needs["send_recv"] = "PP (point-to-point between stages)"
    if layout.world_size > 1:
        needs.setdefault("all_reduce", "the token counts and gradient-norm sums")
    return needs


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a pair's jobs run: ``kind`` is ``cuda`` (one GPU per rank), ``cuda-shared``
    (ranks sharing GPUs over gloo) or ``cpu``; ``text`` says it for the report."""

    kind: str
    text: str
    job_device: str = "auto"
    """What each job of the pair carries (JobSpec.device): ``cpu`` where moved off the GPUs."""

    def apply(self, job: JobSpec) -> JobSpec:
        if job.device == self.job_device:
            return job
        return dataclasses.replace(job, device=self.job_device)


class NotPlaceable(Exception):
    """No device of this session runs the pair; ``detail`` and ``fix`` say why and what would."""

    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


def gpu_count(devices: DeviceSet) -> int:
    """Physical GPUs of a one-machine GPU set (slots ``"0/1"`` are GPU 0's)."""
    return len({d.partition("/")[0] for d in devices.devices})


def place(
    jobs: Sequence[JobSpec],
    devices: DeviceSet,
    mode: str = "auto",
    *,
    fixed: frozenset[str] = frozenset(),
) -> Placement:
    """The pair's placement (see the module docstring); raises :class:`NotPlaceable`.
    ``fixed``: the jobs' backends whose own config decides their device (no
    ``Capabilities.device_follows_placement``): such a pair is never moved or shared."""
    if mode not in DEVICE_MODES:
        raise ValueError(f"device mode must be one of {DEVICE_MODES}, got {mode!r}")
    world = max(job.world_size for job in jobs)
    movable = not any(job.backend in fixed for job in jobs)
    if devices.kind == "cpu":
        if mode == "cuda":
            raise NotPlaceable(
                f"--convergence-device cuda, but {devices.where} has no GPU torch can use",
                "run on a machine with a GPU, or use --convergence-device auto",
            )
        return _cpu(devices, world, job_device="auto")
    if mode == "cpu":
        if not movable:
            raise NotPlaceable(
                "--convergence-device cpu, but a job of this pair runs on the "
                f"{_backends(jobs, fixed)} backend, whose device its own config decides",
                "use --convergence-device auto (or a CPU train config for that backend)",
            )
        return _cpu(devices, world, job_device="cpu")
    if devices.per_node is not None:  # a Slurm allocation: whole GPUs, as the pool places
        problem = devices.placement_problem(world)
        if problem:
            raise NotPlaceable(f"the largest job {problem}", FIX_MORE_DEVICES)
        return Placement(kind="cuda", text=f"cuda: {world} rank(s), one GPU each (NCCL)")
    gpus = gpu_count(devices)
    if world <= gpus:
        return Placement(kind="cuda", text=f"cuda: {world} rank(s), one GPU each (NCCL)")
    why_not_shared = _why_not_shared(jobs, devices, world, gpus, movable=movable, fixed=fixed)
    if why_not_shared is None:
        return Placement(
            kind="cuda-shared",
            text=f"cuda-shared: {world} ranks sharing {gpus} GPU(s) over gloo",
        )
    if mode == "auto" and movable:
        placed = _cpu(_host_cpu(), world, job_device="cpu")
        return dataclasses.replace(placed, text=f"{placed.text}; not on the GPU: {why_not_shared}")
    fixes = [f"run on a machine with {world} GPUs"]
    if movable:
        fixes.append("use --convergence-device auto or cpu (CPU ranks, gloo)")
    raise NotPlaceable(
        f"needs {world} GPUs, this machine has {gpus}; {why_not_shared}", "; ".join(fixes)
    )


FIX_MORE_DEVICES = (
    "run it in a larger allocation (--convergence-launcher slurm inside salloc/sbatch -N "
    "<nodes>), raise --convergence-devices (CPU slots may oversubscribe cores), or lower the "
    "degrees"
)


def _why_not_shared(
    jobs: Sequence[JobSpec],
    devices: DeviceSet,
    world: int,
    gpus: int,
    *,
    movable: bool,
    fixed: frozenset[str],
) -> str | None:
    """Why the pair's ranks cannot share the GPUs; None when they can."""
    if world > len(devices.devices):
        return (
            f"{len(devices.devices)} GPU slots ({len(devices.devices) // max(gpus, 1)} ranks per "
            "GPU, CONVERGENCE_RANKS_PER_GPU)"
        )
    if not movable:
        return f"the {_backends(jobs, fixed)} backend does not share GPUs between ranks"
    for job in jobs:
        for collective, user in layout_collectives(job.layout).items():
            if not GLOO_ON_CUDA.get(collective, False):
                return (
                    f"{job.name} ({job.layout.short_name()}) needs {collective} for {user}, "
                    "which gloo does not run on CUDA tensors"
                )
    return None


def _cpu(devices: DeviceSet, world: int, *, job_device: str) -> Placement:
    problem = devices.placement_problem(world) if devices.kind == "cpu" else None
    if problem:
        raise NotPlaceable(f"the largest job {problem}", FIX_MORE_DEVICES)
    return Placement(kind="cpu", text=f"cpu: {world} rank(s) on CPU (gloo)", job_device=job_device)


def _host_cpu() -> DeviceSet:
    slots = default_cpu_slots()
    return DeviceSet(kind="cpu", devices=tuple(str(i) for i in range(slots)))


def _backends(jobs: Sequence[JobSpec], fixed: frozenset[str]) -> str:
    return "/".join(sorted({job.backend for job in jobs if job.backend in fixed}))

"""Run a job inside a Slurm allocation as one ``srun`` step of ``torchrun`` agents.

    srun --jobid J --job-name STEP --nodes N --ntasks N --ntasks-per-node 1 --nodelist H1,..
         --overlap --kill-on-bad-exit=1 [site srun args]
      python -m torch.distributed.run --nnodes N --nproc-per-node K
         --rdzv-backend c10d --rdzv-endpoint H1:PORT --rdzv-id STEP ... <entry>

Choices (and why):

- *Inside an allocation only.* Outside one (no ``SLURM_JOB_ID``) the launcher refuses with a
  clear error instead of letting ``srun`` allocate per job: every job would queue on its own, the
  wall/idle limits would count queue time, and the device pool (which partitions the devices of
  *this* allocation) would be meaningless. Use ``salloc`` / ``sbatch`` (see
  ``scripts/nightly.sbatch``) and ``--convergence-launcher slurm``.
- *No automatic selection under Slurm.* ``SLURM_JOB_ID`` is also set in interactive ``salloc``
  shells and in CI runners that live inside a Slurm job, where plain local torchrun on the batch
  node is what people ran before and expect; switching silently to ``srun`` steps changes
  accounting, CPU binding and device visibility. Selection is explicit.
- *Nodes.* A job with world size W uses ``ceil(W / per_node)`` nodes (``per_node``: the
  constructor's ``procs_per_node``, else ``SLURM_GPUS_ON_NODE``, else W: one node), which must
  divide W and fit the allocation; the step runs on the first N hosts of
  ``scontrol show hostnames $SLURM_JOB_NODELIST`` and the first is the rendezvous head.
  Multi-node jobs take whole nodes: the device pool's ``CUDA_VISIBLE_DEVICES`` is dropped.
  Under a Runner the device pool places the job instead (``LaunchRequest.hosts``: a slice of
  one node or whole nodes of the allocation, convergence.launch.devices); a GPU slice reaches
  the step as indices that convergence.launch.step_gpus maps through the step's own
  ``CUDA_VISIBLE_DEVICES`` (Slurm replaces the exported one in steps).
- *Port.* With several nodes the endpoint must be known before any agent starts, so the OS
  cannot pick it (``localhost:0``, as the local launcher does). Each launch takes the next
  number of a per-allocation counter kept under a file lock (``state_dir``, node-local on the
  batch host where pytest and its xdist workers run): ``PORT_BASE + (job_id * 7919 + n) %
  PORT_SPAN``. Distinct counters give distinct ports, so two jobs of the same allocation never
  collide; the job-id offset spreads different allocations sharing a node over the range, and
  when the launcher runs on the head node it probes each candidate with ``bind`` and skips
  ports already in use. The range stays below Linux's ephemeral ports (32768+).
- *Nothing left behind.* The local launcher's supervision is reused as is (watchdog, wall and
  idle limits, process-tree kill of ``srun``). The step's processes are children of
  ``slurmstepd``, not of ``srun``, so after every launch (normal end, kill or exception) the
  step is looked up by its unique name and ``scancel``-ed, and we wait until it is gone.
- *Diagnosis.* srun forwards the agents' output into ``launcher.log`` and torchrun writes rank
  logs under ``log_dir`` (which must be on a filesystem shared with the nodes, like the run
  folders), so the local failure diagnosis applies; ``srun: error:`` lines are added when srun
  itself failed before torchrun said anything.

Site-specific srun options (``--gpus-per-task``, ``--cpu-bind=none``, a ``--partition`` for
steps, ...) go in ``srun_args`` or the ``CONVERGENCE_SRUN_ARGS`` environment variable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from convergence.launch.hang_probe import STEP_ENV
from convergence.launch.hang_probe import describe as describe_probe
from convergence.launch.pool import NODE_GPUS_ENV
from convergence.launch.process_tree import DescendantTracker
from convergence.launch.start import LAUNCHER_LOG
from convergence.launch.torchrun import LocalLauncher, build_torchrun_argv, job_env
from convergence.launch.types import FailureInfo, JobResult, LaunchRequest, OnMetrics, OnProgress
from convergence.launch.watch import Verdict
from convergence.spec.errors import SpecError

PORT_BASE = 20000
PORT_SPAN = 12000
"""Rendezvous ports are taken from [PORT_BASE, PORT_BASE + PORT_SPAN): below 32768."""
SRUN_ARGS_ENV = "CONVERGENCE_SRUN_ARGS"
STATE_DIR_ENV = "CONVERGENCE_SLURM_STATE_DIR"
STEP_GONE_TIMEOUT_S = 60.0
HANG_PROBE_TIMEOUT_S = 60.0
_SRUN_ERROR = re.compile(r"^srun: (?:error|fatal): .*$", re.M)


class SlurmError(SpecError):
    """The Slurm environment cannot run a job (no allocation, too few nodes, ...)."""


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """The Slurm allocation this process runs in."""

    job_id: str
    hosts: tuple[str, ...]
    """Hostnames of the allocation, in Slurm's order (the first is the batch host)."""
    gpus_per_node: int | None = None
    cpus_per_node: int | None = None
    """The smallest CPU count of the allocation's nodes (``SLURM_JOB_CPUS_PER_NODE``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, scontrol: str = "scontrol") -> Allocation:
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise SlurmError(
                "the slurm launcher runs jobs inside a Slurm allocation, but SLURM_JOB_ID / "
                "SLURM_JOB_NODELIST are not set",
                key="--convergence-launcher",
                fix="run pytest inside `salloc -N <nodes> ...` or an sbatch script "
                "(see scripts/nightly.sbatch), or use --convergence-launcher local",
            )
        gpus = environ.get("SLURM_GPUS_ON_NODE")
        return cls(
            job_id=job_id,
            hosts=expand_hostnames(nodelist, scontrol=scontrol, environ=environ),
            gpus_per_node=int(gpus) if gpus and gpus.isdigit() else None,
            cpus_per_node=cpus_per_node(environ.get("SLURM_JOB_CPUS_PER_NODE", "")),
        )

    @property
    def head(self) -> str:
        return self.hosts[0]


def cpus_per_node(value: str) -> int | None:
    """``"4(x2),2"`` (Slurm's SLURM_JOB_CPUS_PER_NODE) -> 2: the smallest node's CPUs."""
    counts = [int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", value)]
    return min(counts) if counts else None


def expand_hostnames(
    nodelist: str, *, scontrol: str = "scontrol", environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """``node[01-02]`` -> ``("node01", "node02")`` via ``scontrol show hostnames``."""
    try:
        done = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(environ or os.environ),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(
            f"cannot run `{scontrol} show hostnames {nodelist}`: {exc}",
            key="--convergence-launcher",
            fix="put Slurm's client commands on PATH",
        ) from None
    hosts = tuple(h for h in done.stdout.split() if h)
    if done.returncode != 0 or not hosts:
        raise SlurmError(
            f"`{scontrol} show hostnames {nodelist}` failed: {done.stderr.strip() or 'no hosts'}",
            key="SLURM_JOB_NODELIST",
            fix="run inside a valid allocation",
        )
    return hosts


def port_is_free(port: int) -> bool:
    """Nothing on this host listens on (or holds) ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _job_number(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id)
    return int(digits) if digits else zlib.crc32(job_id.encode())


class PortAllocator:
    """Hands out rendezvous ports for one allocation (see the module docstring)."""

    def __init__(self, job_id: str, state_dir: Path) -> None:
        self.job_id = job_id
        state_dir.mkdir(parents=True, exist_ok=True)
        self._counter = state_dir / f"convergence-slurm-{job_id}.ports"
        self._lock = FileLock(str(self._counter) + ".lock")

    def port_for(self, n: int) -> int:
        return PORT_BASE + (_job_number(self.job_id) * 7919 + n) % PORT_SPAN

    def next(self, *, probe: bool) -> tuple[int, int]:
        """``(port, launch number)``; with ``probe``, skip ports bound on this host."""
        with self._lock:
            try:
                n = int(self._counter.read_text().strip() or 0)
            except (OSError, ValueError):
                n = 0
            port = self.port_for(n)
            for _ in range(PORT_SPAN):
                port = self.port_for(n)
                n += 1
                if not probe or port_is_free(port):
                    break
            self._counter.write_text(str(n))
        return port, n - 1


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """Where and under which name one job runs."""

    step_name: str
    hosts: tuple[str, ...]
    nproc_per_node: int
    port: int | None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:40] or "job"


class SlurmLauncher(LocalLauncher):
    """The ``slurm`` launcher: one ``srun`` step per job (see the module docstring)."""

    name = "slurm"
    on_this_machine = False  # ranks on other nodes: no loopback sockets, no warm start

    def __init__(
        self,
        *,
        environ: Mapping[str, str] | None = None,
        srun_args: Sequence[str] | None = None,
        procs_per_node: int | None = None,
        state_dir: Path | None = None,
        srun: str = "srun",
        scontrol: str = "scontrol",
        squeue: str = "squeue",
        scancel: str = "scancel",
        python: str = sys.executable,
        **local_options: Any,
    ) -> None:
        super().__init__(python=python, start="torchrun", **local_options)
        env = dict(os.environ if environ is None else environ)
        self.allocation = Allocation.from_env(env, scontrol=scontrol)
        self.srun, self.squeue, self.scancel = srun, squeue, scancel
        self.srun_args = tuple(
            srun_args if srun_args is not None else shlex.split(env.get(SRUN_ARGS_ENV, ""))
        )
        self.procs_per_node = procs_per_node
        state = state_dir or Path(env.get(STATE_DIR_ENV) or tempfile.gettempdir())
        self.ports = PortAllocator(self.allocation.job_id, state)
        self._local = threading.local()  # the plan of the launch running on this thread

    # -- planning -------------------------------------------------------------------------
    def num_nodes(self, world_size: int) -> int:
        """Nodes for a job of ``world_size`` ranks (see the module docstring)."""
        per_node = self.procs_per_node or self.allocation.gpus_per_node or world_size
        nodes = max(1, math.ceil(world_size / per_node))
        available = len(self.allocation.hosts)
        if world_size % nodes:
            raise SlurmError(
                f"{world_size} ranks cannot be split evenly over {nodes} nodes "
                f"of {per_node} processes",
                key="procs_per_node",
                fix="choose a world size that is a multiple of the processes per node",
            )
        if nodes > available:
            raise SlurmError(
                f"a job of {world_size} ranks needs {nodes} nodes "
                f"({per_node} per node) but allocation {self.allocation.job_id} "
                f"has {available}",
                key="--nodes",
                fix=f"allocate at least {nodes} nodes (salloc/sbatch -N {nodes})",
            )
        return nodes

    def _on_head(self) -> bool:
        here = {
            socket.gethostname(),
            socket.gethostname().split(".")[0],
            os.environ.get("SLURMD_NODENAME", ""),
        }
        return self.allocation.head in here

    def plan(self, request: LaunchRequest) -> StepPlan:
        if request.hosts and not request.direct:
            # Placed by the device pool (a slice of one node, or whole nodes).
            unknown = [h for h in request.hosts if h not in self.allocation.hosts]
            if unknown or request.nproc % len(request.hosts):
                raise SlurmError(
                    f"job {request.name!r} placed on {request.hosts}, not "
                    f"{request.nproc} ranks on nodes of allocation "
                    f"{self.allocation.job_id} {self.allocation.hosts}",
                    key="--convergence-launcher",
                    fix="use one device pool per allocation (a fresh workdir)",
                )
            hosts = request.hosts
            nodes = len(hosts)
        else:
            nodes = 1 if request.direct else self.num_nodes(request.nproc)
            hosts = self.allocation.hosts[:nodes]
        port, n = (None, 0) if request.direct else self.ports.next(probe=self._on_head())
        # Unique within the allocation (launch number, or PID + time for direct steps): the
        # name is how the step is found again to scancel it.
        tag = f"{n}" if port is not None else f"d{os.getpid()}-{time.monotonic_ns()}"
        step = f"conv-{self.allocation.job_id}-{tag}-{_slug(request.name)}"
        return StepPlan(
            step_name=step, hosts=hosts, nproc_per_node=request.nproc // nodes, port=port
        )

    def srun_argv(
        self, plan: StepPlan, *, suffix: str = "", kill_on_bad_exit: bool = True
    ) -> list[str]:
        """``srun`` with one task per node of ``plan`` in this allocation, named
        ``plan.step_name + suffix`` (how the step is found again), before the command."""
        nodes = str(len(plan.hosts))
        return [
            self.srun,
            "--jobid",
            self.allocation.job_id,
            "--job-name",
            plan.step_name + suffix,
            "--nodes",
            nodes,
            "--ntasks",
            nodes,
            "--ntasks-per-node",
            "1",
            "--nodelist",
            ",".join(plan.hosts),
            # --overlap: steps of one allocation share its resources (the device pool
            # partitions the devices) instead of queueing behind each other.
            "--overlap",
            *(["--kill-on-bad-exit=1"] if kill_on_bad_exit else []),
            *self.srun_args,
        ]

    def build_argv(self, request: LaunchRequest) -> list[str]:
        plan: StepPlan = self._local.plan
        if request.direct:
            return [*self.srun_argv(plan), self.python, *request.entry]
        assert plan.port is not None
        torchrun = build_torchrun_argv(
            request,
            python=self.python,
            nnodes=len(plan.hosts),
            nproc_per_node=plan.nproc_per_node,
            rdzv_endpoint=f"{plan.hosts[0]}:{plan.port}",
            rdzv_id=plan.step_name,
        )
        # A GPU slice of a node: the step narrows Slurm's CUDA_VISIBLE_DEVICES (step_gpus.py).
        wrap = (
            [self.python, "-m", "convergence.launch.step_gpus", "--"]
            if NODE_GPUS_ENV in request.env
            else []
        )
        return [*self.srun_argv(plan), *wrap, *torchrun]

    # -- running --------------------------------------------------------------------------
    def launch(
        self,
        request: LaunchRequest,
        *,
        on_metrics: OnMetrics | None = None,
        on_progress: OnProgress | None = None,
    ) -> JobResult:
        plan = self.plan(request)
        env = {**request.env, STEP_ENV: plan.step_name}  # how hang_probe finds the ranks
        if len(plan.hosts) > 1:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        request = dataclasses.replace(request, env=env)
        self._local.plan = plan
        try:
            result = super().launch(request, on_metrics=on_metrics, on_progress=on_progress)
        finally:
            self._local.plan = None
            self.cancel_step(plan.step_name)
        if result.status in ("failed", "killed") and result.failure is not None:
            result = dataclasses.replace(result, failure=_with_node(_with_srun_errors(result)))
        return result

    def name_hung_rank(
        self, verdict: Verdict, tracker: DescendantTracker, request: LaunchRequest
    ) -> Verdict:
        """Run convergence.launch.hang_probe on the job's nodes (a step of the allocation)
        and add its sentence -- rank, node, file and line -- to the hung verdict."""
        plan: StepPlan | None = self._local.plan
        if plan is None or verdict.failure is None:
            return verdict
        # One probe per node; a node whose probe fails must not end the others' (no
        # --kill-on-bad-exit): their sentences are what the verdict needs.
        argv = [
            *self.srun_argv(plan, suffix="-hang", kill_on_bad_exit=False),
            self.python,
            "-m",
            "convergence.launch.hang_probe",
            plan.step_name,
        ]
        env = job_env(request)
        env.pop(STEP_ENV, None)  # the probe is not one of the job's processes
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=HANG_PROBE_TIMEOUT_S, env=env
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            detail = f"(could not ask the nodes which rank hangs: {exc})"
        else:
            reports = []
            for line in done.stdout.splitlines():
                try:
                    reports.append(json.loads(line))
                except ValueError:
                    continue
            detail = (
                describe_probe(reports)
                if reports
                else (f"(could not ask the nodes which rank hangs: {done.stderr.strip()[-200:]})")
            )
        if not detail:
            return verdict
        failure = dataclasses.replace(
            verdict.failure, message=f"{verdict.failure.message}; {detail}"
        )
        return dataclasses.replace(verdict, failure=failure)

    def step_ids(self, step_name: str) -> list[str]:
        """IDs (``job.step``) of this allocation's live steps named ``step_name``."""
        try:
            done = subprocess.run(
                [
                    self.squeue,
                    "--steps",
                    "--noheader",
                    "--jobs",
                    self.allocation.job_id,
                    "--format",
                    "%i %j",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return []
        ids = []
        for line in done.stdout.splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[1].strip() == step_name:
                ids.append(parts[0])
        return ids

    def cancel_step(self, step_name: str, timeout_s: float = STEP_GONE_TIMEOUT_S) -> list[str]:
        """scancel the step if it still exists and wait until Slurm no longer lists it;
        returns the step IDs that had to be cancelled."""
        ids = self.step_ids(step_name)
        if not ids:
            return []
        subprocess.run([self.scancel, *ids], capture_output=True, timeout=30)
        deadline = time.monotonic() + timeout_s
        while self.step_ids(step_name) and time.monotonic() < deadline:
            time.sleep(0.2)
        return ids


def _with_node(failure: FailureInfo) -> FailureInfo:
    """ "rank 3 was killed" -> "rank 3 on node gpu08 was killed": on a cluster the node is
    where to look (its logs, its health)."""
    if failure.node is None or failure.rank is None:
        return failure
    rank = f"rank {failure.rank}"
    message = failure.message.replace(f"{rank} ", f"{rank} on node {failure.node} ", 1)
    return dataclasses.replace(failure, message=message)


def _with_srun_errors(result: JobResult) -> FailureInfo:
    """Add srun's own error lines when torchrun did not explain the failure."""
    failure = result.failure
    assert failure is not None
    if failure.traceback or failure.rank is not None:
        return failure
    try:
        text = (result.log_dir / LAUNCHER_LOG).read_text(errors="replace")
    except OSError:
        return failure
    errors = _SRUN_ERROR.findall(text)
    if not errors:
        return failure
    detail = "; ".join(e.removeprefix("srun: ") for e in errors[-3:])
    return dataclasses.replace(
        failure, message=f"{failure.message} [{detail}]", traceback="\n".join(errors) + "\n"
    )

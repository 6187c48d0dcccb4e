"""The job level: one job from its spec to its curves, through the session's launcher,
device pool and run cache.

    JobSpec -> backend -> seed checkpoint -> run-cache key -> cached entry or fresh launch
            -> SideOutcome (metrics, meta, result)

Nothing here knows about pairs, rules or verdicts: that is the pair level (run/runner.py),
which builds on this one and which this module never imports. The numerics probe
(run/probe.py), a resuming side (run/resume.py) and ``convergence ab`` use this tier alone:
:meth:`JobRunner.launch_request` (the one place a LaunchRequest is built),
:meth:`JobRunner.launch` (leases devices from the pool), :meth:`JobRunner.prepare` (backend,
seed checkpoint and key, once per job), :meth:`JobRunner.cached_run` (claim a run-cache key;
reuse its entry or produce and commit one) and :meth:`JobRunner.run_job`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from convergence.backends import Backend, get_backend
from convergence.cache.key import cache_key, code_version, hardware_fingerprint
from convergence.cache.stack import stack_fingerprint
from convergence.cache.store import RunCache
from convergence.launch.devices import session_devices
from convergence.launch.fork_servers import ForkServers
from convergence.launch.pool import DevicePool, default_cpu_slots
from convergence.launch.slurm import SlurmLauncher
from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import JobResult, Launcher, LaunchRequest, Progress
from convergence.rank.hooks import locate_hook_module
from convergence.run.outcome import SideOutcome
from convergence.spec.errors import RunFailed, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.run_dir import RunDir
from convergence.torch_info import torch_version

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Session-wide settings (from pytest options / CLI flags)."""

    work_dir: Path
    """Root for run folders, the device-pool state and (by default) the cache."""
    cache_dir: Path | None = None
    """Run cache root; default ``work_dir / "cache"``."""
    refresh: bool = False
    """Ignore cached runs (they are replaced by fresh ones)."""
    early_stop: bool = True
    launcher: str = "local"
    """``local`` (torchrun) or ``slurm`` (srun + torchrun)."""
    devices: int | None = None
    """Devices (GPUs, or CPU slots) the pool may hand out; None = detect."""
    steps: int | None = None
    """Override every job's steps (quick looks)."""
    alpha: float | None = None
    """``--alpha``: override the level of every rule whose comparison takes one
    (``Comparison.takes_alpha``: today the seed band's equivalence test). A session option
    like the others here; no regime is named for it."""
    backend: str | None = None
    """Override every job's backend."""
    wall_limit_s: float = 3600.0
    idle_limit_s: float = 300.0
    job_cwd: Path | None = None
    """Where jobs run (default: the current directory). ``convergence ab`` runs each side in a
    worktree of the trainer's repository, so relative commands resolve there."""
    job_env: tuple[tuple[str, str], ...] = ()
    """Extra environment for every job (``convergence ab``: PYTHONPATH = the worktree)."""
    key_extra: tuple[tuple[str, str], ...] = ()
    """More identity for every run-cache key, where the key's own parts do not cover the code
    a job runs (``convergence bisect``: the commit's trainer code, see convergence/bisection.py)."""
    session_id: str = field(default_factory=lambda: f"{os.getpid()}-{time.time_ns()}")
    """Identifies one pytest/CLI run (shared by its xdist workers): see ``refresh``."""
    concurrent_controls: bool = True
    """A pair's independent control-side jobs (control, twins, seed replicates) run at once as
    far as the device pool has room (run/together.py); False: one after another."""
    on_progress: Callable[[Progress], None] | None = field(default=None, compare=False)

    @property
    def cache_root(self) -> Path:
        return self.cache_dir or self.work_dir / "cache"


class JobFailed(RunFailed):
    """A job ended without usable metrics (crash, hang, timeout, signal)."""

    def __init__(self, side: str, job: JobSpec, result: JobResult) -> None:
        self.side, self.job, self.result = side, job, result
        failure = result.failure
        what = failure.message if failure else f"ended with status {result.status}"
        text = f"{side} job {job.name!r} ({job.layout.short_name()}) {what}"
        if failure and failure.traceback:
            text += "\n" + failure.traceback.strip()
        text += f"\n  logs: {result.log_dir}"
        super().__init__(text)


def apply_job_settings(job: JobSpec, settings: RunSettings) -> JobSpec:
    """Session overrides of a job (steps, backend)."""
    changes: dict[str, Any] = {}
    if settings.steps is not None:
        changes["steps"] = settings.steps
    if settings.backend is not None:
        changes["backend"] = settings.backend
    return dataclasses.replace(job, **changes) if changes else job


def slug(text: str) -> str:
    """``text`` as a folder name (run folders are named after jobs and pairs)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:80] or "run"


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class PreparedJob:
    """What running ``job`` needs besides the job itself (:meth:`JobRunner.prepare`)."""

    job: JobSpec
    backend: Backend
    seed_dir: Path | None
    """The shared seed checkpoint (None: the backend has none)."""
    key: str
    """The job's run-cache key."""


class JobRunner:
    """The job level: the session's launcher, device pool and run cache, and the jobs run
    through them (seed checkpoint, cache key, cached or fresh run).

    Building one costs device detection (imports torch on a CUDA or ROCm build), a sweep of the
    cache's temporary folders and, under Slurm, ``scontrol``: build it once per session (per
    process: each xdist worker has its own) and reuse it for every job.
    """

    def __init__(
        self,
        settings: RunSettings,
        *,
        launcher: Launcher | None = None,
        fork_servers: ForkServers | None = None,
    ) -> None:
        self.settings = settings
        settings.work_dir.mkdir(parents=True, exist_ok=True)
        self.cache = RunCache(settings.cache_root)
        device_set = session_devices(settings.launcher, settings.devices)
        self.pool = DevicePool(
            settings.work_dir / "pool",
            device_set.devices,
            device_set.kind,
            per_node=device_set.per_node,
            where=device_set.where,
        )
        # Pairs placed on CPU on a GPU machine (convergence.launch.placement) lease CPU slots,
        # accounted apart from the GPUs (their own state file in the same folder).
        self.cpu_pool = (
            DevicePool(settings.work_dir / "pool", default_cpu_slots(), "cpu")
            if device_set.kind == "gpu" and device_set.per_node is None
            else None
        )
        self.launcher = launcher or _make_launcher(settings.launcher, fork_servers)
        self._on_progress = settings.on_progress
        self._prepared: dict[JobSpec, PreparedJob] = {}
        self._backends: dict[str, Backend] = {}
        # A pair's control-side jobs run on threads of their own (run/together.py): one
        # prepares at a time, so a seed checkpoint or a backend is made once.
        self._prepare_lock = threading.RLock()

    def reporting_to(self, on_progress: Callable[[Progress], None] | None) -> JobRunner:
        """This job level (the same launcher, pools, cache and prepared jobs) with its jobs'
        progress going to ``on_progress`` (None: ``settings.on_progress``).

        Why a view and not a setter: the pair level gives each pair its own printer (the
        plugin prints per test item) while the job level lives for the session, and a pair's
        control-side jobs run on threads of their own; a view per pair leaves nothing to reset.
        """
        view = copy.copy(self)  # shallow: every shared part stays the very same object
        view._on_progress = on_progress or self.settings.on_progress
        return view

    # -- the public job API (run.probe, run.resume, ab, and the pair level's Runner) -------
    @property
    def session_id(self) -> str:
        return self.settings.session_id

    def backend(self, job: JobSpec) -> Backend:
        """``job``'s backend: one instance per backend name and session (backends hold no
        state of their own; what they work out of a job is kept per job: backends/effective.py)."""
        with self._prepare_lock:
            backend = self._backends.get(job.backend)
            if backend is None:
                backend = self._backends[job.backend] = get_backend(job.backend)
            return backend

    def prepare(self, job: JobSpec) -> PreparedJob:
        """``job``'s backend, seed checkpoint and run-cache key, worked out once per session.

        Why once: the seed identity is read from the backend's effective train config (the
        built-in trainer's TOML merged with the job's overrides; torchtitan's config module),
        which the backend works out once per job and process (backends/effective.py: the
        collection's checks usually did already), and the key hashes the config text, the
        code, the hardware and the hook's source. A job's run, its resume and its probes (two
        per side) all need them; they cannot change within a session, and the seed
        checkpoint, once made, stays in the cache.
        """
        with self._prepare_lock:
            prepared = self._prepared.get(job)
            if prepared is None:
                backend = self.backend(job)
                seed_dir = self.seed_checkpoint(job, backend)
                key = self.job_key(job, backend, seed_dir)
                prepared = self._prepared[job] = PreparedJob(
                    job=job, backend=backend, seed_dir=seed_dir, key=key
                )
            return prepared

    def launch_request(
        self,
        name: str,
        entry: Sequence[str],
        *,
        nproc: int,
        log_dir: Path,
        watch_idle: bool = True,
        in_job_context: bool = False,
        metrics_path: Path | None = None,
        metrics_format: str = "jsonl",
        stop_file: Path | None = None,
        total_steps: int | None = None,
        direct: bool = False,
        forkable: bool = False,
        warm_imports: Sequence[str] = (),
    ) -> LaunchRequest:
        """The one place a LaunchRequest is built from the session's settings.

        ``watch_idle`` False: the idle limit is the wall limit (a seed checkpoint or a probe
        logs no steps to watch). ``in_job_context``: run in ``settings.job_cwd`` with
        ``settings.job_env`` (``convergence ab``'s worktree); training jobs do, the seed
        checkpoint and the probe run in the current directory.
        """
        limits = self.settings
        return LaunchRequest(
            name=name,
            entry=entry,
            nproc=nproc,
            log_dir=log_dir,
            metrics_path=metrics_path,
            metrics_format=metrics_format,
            stop_file=stop_file,
            total_steps=total_steps,
            wall_limit_s=limits.wall_limit_s,
            idle_limit_s=limits.idle_limit_s if watch_idle else limits.wall_limit_s,
            cwd=(limits.job_cwd or Path.cwd()) if in_job_context else Path.cwd(),
            env=dict(limits.job_env) if in_job_context else {},
            direct=direct,
            forkable=forkable,
            warm_imports=tuple(warm_imports),
        )

    def launch(
        self,
        request: LaunchRequest,
        world_size: int,
        on_metrics: Callable[[dict[str, float]], bool] | None = None,
        *,
        device: str = "auto",
    ) -> JobResult:
        """Launch on ``world_size`` devices leased from the session's pool (waits for them);
        ``device`` ``cpu`` (a job placed on CPU, JobSpec.device): on CPU slots, GPUs hidden."""
        pool, hide = self.pool, {}
        if device == "cpu" and self.cpu_pool is not None:
            pool, hide = self.cpu_pool, {"CUDA_VISIBLE_DEVICES": ""}
        with pool.lease(world_size, timeout=self.settings.wall_limit_s) as lease:
            request = dataclasses.replace(
                request, env={**request.env, **lease.env, **hide}, hosts=lease.hosts
            )
            return self.launcher.launch(
                request, on_metrics=on_metrics, on_progress=self._on_progress
            )

    def job_key(self, job: JobSpec, backend: Backend, seed_dir: Path | None) -> str:
        """The run-cache key of ``job`` (identity, config text, code, torch, hardware, the
        accelerator stack and numerics environment (cache/stack.py), hook source, seed
        checkpoint): what makes a cached run trustworthy as this job's."""
        identity = dict(job.identity())
        identity["seed_checkpoint"] = seed_dir.parent.name if seed_dir else None
        identity["hook_source"] = _hook_source_hash(job.hook)
        if self.settings.key_extra:  # only when set: every other key stays what it was
            identity["key_extra"] = dict(self.settings.key_extra)
        hardware = f"{hardware_fingerprint()} {stack_fingerprint(self._job_environ())}"
        return cache_key(
            identity,
            train_config_text=backend.config_text(job),
            backend_version=backend.version(),
            code_version=code_version(),
            torch_version=torch_version(),
            hardware=hardware,
        )

    def _job_environ(self) -> dict[str, str]:
        """The environment jobs start with (launch/torchrun.job_env: one OpenMP thread unless
        set), as the cache key's numerics part sees it."""
        env = {**os.environ, **dict(self.settings.job_env)}
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def cached_run(
        self,
        key: str,
        produce: Callable[[], Path],
        *,
        usable: Callable[[Path], bool],
        read: Callable[[Path, bool], T],
        refreshable: bool = True,
    ) -> T:
        """``read(entry, cached)`` of the cache entry for ``key``: the stored one when
        ``usable`` accepts it (and, with --refresh, this session made it), else
        ``produce()``'s folder, committed. The key stays claimed until ``read`` returns, so
        runs sharing it (xdist workers, pairs) produce it once and no one replaces an entry
        that is being read. ``refreshable`` False: --refresh does not apply (a seed
        checkpoint: the same weights whoever made them)."""
        with self.cache.claim(key) as claim:
            if (
                claim.path is not None
                and usable(claim.path)
                and (not refreshable or self._reusable(claim.path))
            ):
                return read(claim.path, True)
            entry: Path = claim.commit(produce())
            return read(entry, False)

    # -- jobs ---------------------------------------------------------------------------

    def seed_checkpoint(self, job: JobSpec, backend: Backend) -> Path | None:
        """Create the seed checkpoint once (one process), shared by every layout and pair."""
        identity = backend.seed_identity(job)
        if identity is None:
            return None
        key = _hash({"seed_checkpoint": identity})
        build = self.settings.work_dir / "tmp" / f"{key}-{os.getpid()}"

        def produce() -> Path:
            shutil.rmtree(build, ignore_errors=True)
            request = self.launch_request(
                f"seed-checkpoint {job.name}",
                backend.seed_entry(job, build / "seed"),
                nproc=1,
                log_dir=build / "logs",
                # A rank of a one-rank job (torchtitan wants a process group), or one plain
                # process of ours; both start forked from the warm server where there is one.
                direct=not backend.capabilities.seed_is_a_job,
                forkable=True,
                watch_idle=False,
                # The server its jobs fork from: no second one started for this process alone.
                warm_imports=backend.capabilities.warm_imports,
            )
            result = self.launcher.launch(request)  # one process: no lease from the pool
            if not result.ok:
                raise JobFailed("seed-checkpoint", job, result)
            return build

        def read(entry: Path, cached: bool) -> Path:
            # Made here and stored: the build folder goes (a read-only cache keeps nothing:
            # the build folder is the entry, used in place).
            if not cached and entry != build:
                shutil.rmtree(build, ignore_errors=True)
            return entry / "seed"

        return self.cached_run(key, produce, usable=_any_entry, read=read, refreshable=False)

    def run_job(
        self,
        side: str,
        job: JobSpec,
        *,
        pair_dir: Path,
        cacheable: bool,
        on_metrics: Callable[[dict[str, float]], bool] | None = None,
    ) -> SideOutcome:
        """Run ``job`` (from the run cache when ``cacheable`` and a usable entry exists) and
        read its side; raises :class:`JobFailed` when it ends without usable metrics."""
        prepared = self.prepare(job)
        backend, seed_dir, key = prepared.backend, prepared.seed_dir, prepared.key
        if cacheable:
            fresh: list[JobResult] = []

            def produce() -> Path:
                run_dir, result = self._run_fresh(
                    side, job, backend, seed_dir, pair_dir, key, on_metrics
                )
                fresh.append(result)
                return run_dir

            return self.cached_run(
                key,
                produce,
                usable=lambda path: self._complete(path, job, backend),
                read=lambda entry, cached: self._side_from_dir(
                    job, backend, entry, cached=cached, result=fresh[0] if fresh else None
                ),
            )
        run_dir, result = self._run_fresh(side, job, backend, seed_dir, pair_dir, key, on_metrics)
        return self._side_from_dir(job, backend, run_dir, cached=False, result=result)

    @staticmethod
    def _complete(entry: Path, job: JobSpec, backend: Backend) -> bool:
        """A cached run counts only if it holds what a run must: its metrics file and our job
        record (the cache verifies the files against the manifest; this, that they exist)."""
        folder = RunDir(entry)
        metrics = backend.metrics_path(job, folder.dump.path)
        # exists(): a TensorBoard backend's metrics are a folder of event files.
        if folder.job_record.is_file() and (metrics is None or metrics.exists()):
            return True
        log.warning("run cache: entry %s lacks its metrics or job record; running again", entry)
        return False

    def _reusable(self, entry: Path) -> bool:
        """With --refresh, an entry counts only if this very session produced it: a control
        shared by many pairs still runs once per session."""
        if not self.settings.refresh:
            return True
        return bool(_recorded(entry, "session") == self.settings.session_id)

    def _run_fresh(
        self,
        side: str,
        job: JobSpec,
        backend: Backend,
        seed_dir: Path | None,
        pair_dir: Path,
        key: str,
        on_metrics: Callable[[dict[str, float]], bool] | None,
    ) -> tuple[Path, JobResult]:
        run_dir = pair_dir / f"{side}-{slug(job.name)}-{key[:10]}"
        shutil.rmtree(run_dir, ignore_errors=True)
        folder = RunDir(run_dir)
        dump = folder.dump.path
        request = self.launch_request(
            f"{job.name} {side}",
            backend.train_entry(job, dump, seed_dir),
            nproc=job.world_size,
            log_dir=folder.logs,
            in_job_context=True,
            metrics_path=backend.metrics_path(job, dump),
            metrics_format=backend.metrics_format(job),
            stop_file=backend.stop_file(job, dump),
            total_steps=job.steps,
            direct=backend.launches_itself(job),
            warm_imports=backend.capabilities.warm_imports,
        )
        result = self.launch(request, job.world_size, on_metrics, device=job.device)
        folder.job_record.write_text(
            json.dumps(
                {
                    "job": job.identity(),
                    "name": job.name,
                    "status": result.status,
                    "wall_s": result.wall_s,
                    "key": key,
                    "session": self.settings.session_id,
                    "note": result.failure.message if result.ok and result.failure else None,
                },
                indent=2,
                default=str,
            )
        )
        # A NaN test job still gives a verdict (its curve up to the NaN); a NaN control must
        # not: it would be cached and trusted as the reference for every later session.
        if not result.ok and (result.status != "nan" or side != "test"):
            raise JobFailed(side, job, result)
        return run_dir, result

    def _side_from_dir(
        self,
        job: JobSpec,
        backend: Backend,
        run_dir: Path,
        *,
        cached: bool,
        result: JobResult | None = None,
    ) -> SideOutcome:
        dump = RunDir(run_dir).dump.path
        wall = result.wall_s if result else _recorded_wall(run_dir)
        return SideOutcome(
            job=job,
            metrics=backend.read_metrics(job, dump),
            result=result,
            cached=cached,
            run_dir=run_dir,
            wall_s=wall,
            meta=backend.read_meta(job, dump),
        )


def _any_entry(entry: Path) -> bool:
    """A seed checkpoint's entry is usable as the cache verified it (no job record)."""
    return True


def _recorded(run_dir: Path, key: str) -> Any:
    try:
        return json.loads(RunDir(run_dir).job_record.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _recorded_wall(run_dir: Path) -> float:
    return float(_recorded(run_dir, "wall_s") or 0.0)


def _hook_source_hash(hook: str | None) -> str | None:
    """A user's hook is code we run: its source belongs in the cache key. Located, never
    imported (importlib.util.find_spec would import its parent packages here)."""
    if not hook:
        return None
    spec = locate_hook_module(hook.split(":", 1)[0])
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


def _make_launcher(name: str, fork_servers: ForkServers | None = None) -> Launcher:
    """``fork_servers``: the session's (it closes them); None: the process's shared set."""
    if name == "local":
        return LocalLauncher(fork_servers=fork_servers)
    if name == "torchrun":
        return LocalLauncher(start="torchrun", fork_servers=fork_servers)
    if name == "slurm":
        return SlurmLauncher()
    raise SpecError(
        f"unknown launcher {name!r}",
        key="--convergence-launcher",
        fix="use local, torchrun or slurm",
    )

"""Failure localisation: run the numerics probe on both sides of a pair and compare.

When a paired pair fails (or always, for pairs with ``probe = "always"``), each side runs once
more in probe mode -- same launcher, same device pool, same seed checkpoint, the run cache, overrides
``--probe.enable=true --probe.step=S --training.steps=1`` -- and the two probe.json files are
compared (convergence.probe_compare). The result becomes ``PairOutcome.localisation``.

A probe never changes a verdict: whatever goes wrong here is recorded as
``{"error": "..."}`` in the localisation, never raised.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convergence.launch.types import JobResult, LaunchRequest
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec

LaunchFn = Callable[[LaunchRequest, int], JobResult]
SeedFn = Callable[[JobSpec, Any], "Path | None"]


def wants_probe(pair: PairSpec, status: str) -> bool:
    """Probe a failed paired pair (unless switched off), or any judged pair asked to."""
    if pair.control.backend != "builtin" or pair.test.backend != "builtin" or pair.golden:
        return False  # only the built-in trainer has a probe mode
    if getattr(pair, "probe_always", False) and status in ("passed", "failed"):
        return True
    return status == "failed" and pair.regime == "paired" and pair.probe_on_failure


def probe_overrides(step: int) -> list[str]:
    return ["--probe.enable=true", f"--probe.step={step}", "--training.steps=1"]


def run_probe_job(side: str, job: JobSpec, probe_dir: Path, *, launch: LaunchFn,
                  seed_checkpoint: SeedFn, wall_limit_s: float, step: int = 1) -> Path:
    """Run ``job`` in probe mode; returns its probe.json (raises RuntimeError on failure)."""
    from convergence.backends.builtin import BuiltinBackend
    from convergence.trainer.probe import PROBE_FILE

    backend = BuiltinBackend()
    seed_dir = seed_checkpoint(job, backend)
    dump = probe_dir / side / "dump"
    request = LaunchRequest(
        name=f"{job.name} probe", nproc=job.world_size,
        entry=[*backend.train_entry(job, dump, seed_dir), *probe_overrides(step)],
        log_dir=probe_dir / side / "logs", wall_limit_s=wall_limit_s,
        idle_limit_s=wall_limit_s, cwd=Path.cwd())
    result = launch(request, job.world_size)
    if not result.ok:
        what = result.failure.message if result.failure else f"status {result.status}"
        raise RuntimeError(f"{side} probe job {job.name!r} {what} (logs: {result.log_dir})")
    path = dump / PROBE_FILE
    if not path.is_file():
        raise RuntimeError(f"{side} probe job {job.name!r} wrote no {path}")
    return path


def cached_probe(runner: Any, side: str, job: JobSpec, probe_dir: Path, step: int) -> Path:
    """probe.json of ``job``, from the run cache when this job was probed before.

    ``runner`` is the :class:`convergence.runner.Runner` (its cache, launcher, pool and seed
    checkpoints). The key extends the job's run-cache key, so a control shared by many pairs
    is probed once, and ``--refresh`` reprobes once per session as it reruns jobs.
    """
    from convergence.backends import get_backend
    from convergence.trainer.probe import PROBE_FILE

    backend = get_backend(job.backend)
    job_key = runner._job_key(job, backend, runner.seed_checkpoint(job, backend))
    key = hashlib.sha256(json.dumps({"probe_step": step, "job": job_key}).encode()).hexdigest()
    with runner.cache.claim(key) as claim:
        if claim.path is not None and runner._reusable(claim.path):
            cached: Path = claim.path / "dump" / PROBE_FILE
            if cached.is_file():
                return cached
        path = run_probe_job(side, job, probe_dir, launch=runner._launch,
                             seed_checkpoint=runner.seed_checkpoint,
                             wall_limit_s=runner.settings.wall_limit_s, step=step)
        side_dir = path.parent.parent
        (side_dir / "job.json").write_text(json.dumps(
            {"job": job.identity(), "name": job.name, "probe_step": step,
             "session": runner.settings.session_id}, default=str))
        entry: Path = claim.commit(side_dir)
        return entry / "dump" / PROBE_FILE


def localise(pair: PairSpec, pair_dir: Path, *, runner: Any, step: int = 1) -> dict[str, Any]:
    """Probe both sides (cached) and compare; errors are returned in the dict, never raised."""
    from convergence.probe_compare import compare_probe_files

    probe_dir = pair_dir / "probe"
    try:
        paths = [cached_probe(runner, side, job, probe_dir, step)
                 for side, job in (("control", pair.control), ("test", pair.test))]
        result = compare_probe_files(paths[0], paths[1])
    except Exception as exc:  # noqa: BLE001 - a probe must never turn a verdict into an error
        return {"error": f"numerics probe failed: {exc}", "step": step}
    result["probe_files"] = f"{paths[0]} vs {paths[1]}"
    return result

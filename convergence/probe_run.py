"""Failure localisation: run the numerics probe on both sides of a pair and compare.

When a paired pair fails (or always, for pairs with ``probe = "always"``), each side runs once
more in probe mode -- same launcher, same device pool, same seed checkpoint, overrides
``--probe.enable=true --probe.step=S --training.steps=1`` -- and the two probe.json files are
compared (convergence.probe_compare). The result becomes ``PairOutcome.localisation``.

A probe never changes a verdict: whatever goes wrong here is recorded as
``{"error": "..."}`` in the localisation, never raised.
"""

from __future__ import annotations

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


def localise(pair: PairSpec, pair_dir: Path, *, launch: LaunchFn, seed_checkpoint: SeedFn,
             wall_limit_s: float, step: int = 1) -> dict[str, Any]:
    """Probe both sides and compare; errors are returned in the dict, never raised."""
    from convergence.probe_compare import compare_probe_files

    probe_dir = pair_dir / "probe"
    try:
        paths = [run_probe_job(side, job, probe_dir, launch=launch,
                               seed_checkpoint=seed_checkpoint, wall_limit_s=wall_limit_s,
                               step=step)
                 for side, job in (("control", pair.control), ("test", pair.test))]
        result = compare_probe_files(paths[0], paths[1])
    except Exception as exc:  # a probe must never turn a verdict into an error
        return {"error": f"numerics probe failed: {exc}", "step": step}
    result["probe_dir"] = str(probe_dir)
    return result

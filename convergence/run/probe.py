"""Failure localisation: run the numerics probe on both sides of a pair and compare.

When a paired pair fails (or always, for pairs with ``probe = "always"``), each side runs once
more in probe mode -- same launcher, same device pool, same seed checkpoint, the run cache, its
trainer asked for the probe of step S (``JobSpec.request``: the built-in trainer's
``--probe.enable=true --probe.step=S``) -- and the two probe.json files are compared
(convergence.run.probe_compare). The result becomes ``PairOutcome.localisation``.

Two steps are probed, the second only when needed:
1. step 1, from the seed weights: a wrong parallel plan shows here, for the cost of one step;
2. when step 1 agrees everywhere but the curves part later (a bug that needs optimizer steps:
   an LR schedule, optimizer-state sharding, accumulation, ...), the first divergent step K of
   the verdicts. The probe job replays steps 1..K-1 of the run (see convergence.trainer.probe
   for why a replay and not a checkpoint) and records step K; the replayed losses are compared
   with the run's (``replay_loss_max_abs_diff``, 0.0 when the replay was exact). Cost: K steps
   per side, at most a rerun of the pair up to the divergence; the control's probe is cached.

A probe never changes a verdict: whatever goes wrong here is recorded as
``{"error": "..."}`` in the localisation, never raised.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from convergence.backends import get_backend
from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import read_jsonl
from convergence.regimes import get_regime
from convergence.run.jobs import JobRunner
from convergence.run.probe_compare import compare_probe_files
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.spec.run_dir import DumpDir, RunDir


def wants_probe(pair: PairSpec, status: str) -> bool:
    """Probe a failed pair whose regime allows it (paired, twin; unless switched off), or any
    judged pair asked to. A seed-band pair has no common starting point to probe (other
    seeds, other weights)."""
    sides = (pair.control, pair.test)
    if pair.golden or not all(get_backend(job.backend).capabilities.probe for job in sides):
        return False  # a golden curve has no trainer; only some trainers have a probe mode
    if getattr(pair, "probe_always", False) and status in ("passed", "failed"):
        return True
    return status == "failed" and get_regime(pair.regime).probe_on_failure and pair.probe_on_failure


def run_probe_job(
    side: str, job: JobSpec, probe_dir: Path, *, runner: JobRunner, step: int = 1
) -> Path:
    """Run ``job`` in probe mode through ``runner`` (its launcher, device pool and seed
    checkpoints); returns its probe.json (raises RuntimeError on failure)."""
    backend = runner.backend(job)  # one with a probe mode (wants_probe)
    seed_dir = runner.prepare(job).seed_dir
    folder = RunDir(probe_dir / side)
    dump = folder.dump
    # training.steps stays the job's: the LR schedule of the replayed steps depends on it.
    probing = job.asking(probe_step=step)
    request = runner.launch_request(
        f"{job.name} probe",
        backend.train_entry(probing, dump.path, seed_dir),
        nproc=job.world_size,
        log_dir=folder.logs,
        watch_idle=False,
        warm_imports=backend.capabilities.warm_imports,
    )
    result = runner.launch(request, job.world_size, device=job.device)
    if not result.ok:
        what = result.failure.message if result.failure else f"status {result.status}"
        raise RuntimeError(f"{side} probe job {job.name!r} {what} (logs: {result.log_dir})")
    path = dump.probe
    if not path.is_file():
        raise RuntimeError(f"{side} probe job {job.name!r} wrote no {path}")
    return path


def probe_from_checkpoint(
    runner: JobRunner,
    control: JobSpec,
    test: JobSpec,
    checkpoint: Path,
    probe_dir: Path,
    *,
    step: int,
    head: Mapping[str, Any],
    failed: str,
) -> dict[str, Any]:
    """The numerics probe of ``step`` on both layouts, each loading ``checkpoint`` (a resume,
    then the probe: convergence/trainer/probe.py), compared module by module -- instead of
    replaying the run up to there. ``head``: what says where the probe started; ``failed``:
    what an error reads as ("numerics probe <failed> failed: ..."). Errors are recorded,
    never raised (a probe never changes a verdict)."""
    try:
        paths = [
            run_probe_job(
                side,
                job.asking(resume_from=checkpoint),
                probe_dir,
                runner=runner,
                step=step,
            )
            for side, job in (("control", control), ("test", test))
        ]
        result = compare_probe_files(paths[0], paths[1])
    except Exception as exc:  # noqa: BLE001 - a probe must never turn a verdict into an error
        return {"error": f"numerics probe {failed} failed: {exc}", "step": step}
    said = {**head, "probe_files": f"{paths[0]} vs {paths[1]}"}
    # Scalars first (the failure message prints them in order), then the tables.
    return {
        **{k: v for k, v in result.items() if not isinstance(v, list)},
        **said,
        **{k: v for k, v in result.items() if isinstance(v, list)},
    }


def cached_probe(runner: JobRunner, side: str, job: JobSpec, probe_dir: Path, step: int) -> Path:
    """probe.json of ``job``, from the run cache when this job was probed before.

    The key extends the job's run-cache key, so a control shared by many pairs is probed
    once, and ``--refresh`` reprobes once per session as it reruns jobs.
    """
    job_key = runner.prepare(job).key
    key = hashlib.sha256(json.dumps({"probe_step": step, "job": job_key}).encode()).hexdigest()

    def produce() -> Path:
        path = run_probe_job(side, job, probe_dir, runner=runner, step=step)
        side_dir = path.parent.parent
        RunDir(side_dir).job_record.write_text(
            json.dumps(
                {
                    "job": job.identity(),
                    "name": job.name,
                    "probe_step": step,
                    "session": runner.session_id,
                },
                default=str,
            )
        )
        return side_dir

    return runner.cached_run(
        key,
        produce,
        usable=lambda path: RunDir(path).dump.probe.is_file(),
        read=lambda entry, cached: RunDir(entry).dump.probe,
    )


def _probe_step(
    pair: PairSpec, pair_dir: Path, runner: JobRunner, step: int
) -> tuple[dict[str, Any], list[Path]]:
    """Probe both sides (cached) at ``step`` and compare; errors in the dict, never raised."""
    probe_dir = pair_dir / "probe" / f"step{step}"
    try:
        paths = [
            cached_probe(runner, side, job, probe_dir, step)
            for side, job in (("control", pair.control), ("test", pair.test))
        ]
        result = compare_probe_files(paths[0], paths[1])
    except Exception as exc:  # noqa: BLE001 - a probe must never turn a verdict into an error
        return {"error": f"numerics probe failed: {exc}", "step": step}, []
    result["probe_files"] = f"{paths[0]} vs {paths[1]}"
    return result, paths


def agrees(result: Mapping[str, Any]) -> bool:
    """A probe comparison that found no differing module or gradient (and no error)."""
    return (
        "error" not in result and result.get("module") is None and (result.get("parameter") is None)
    )


def replay_deviation(
    probe_files: Sequence[Path], runs: Sequence[RunMetrics], step: int
) -> float | None:
    """Largest |replayed loss - run's loss| over the steps before ``step`` (both sides).

    The probe job's metrics.jsonl (beside probe.json) holds the replayed steps; None when
    there is nothing to compare (e.g. log_freq skipped them all)."""
    worst: float | None = None
    for path, run in zip(probe_files, runs, strict=True):
        replay, original = read_jsonl(DumpDir(path.parent).metrics).get("loss"), run.get("loss")
        if replay is None or original is None:
            continue
        logged = dict(zip(original.steps.tolist(), original.values.tolist(), strict=True))
        for s, value in zip(replay.steps.tolist(), replay.values.tolist(), strict=True):
            if s < step and s in logged:
                diff = abs(value - logged[s])
                worst = diff if worst is None or diff > worst else worst
    return worst


def localise(
    pair: PairSpec,
    pair_dir: Path,
    *,
    runner: JobRunner,
    divergent_step: int | None = None,
    runs: Sequence[RunMetrics] = (),
) -> dict[str, Any]:
    """Probe at step 1; when all agrees there, at ``divergent_step`` (see the module doc).

    ``runs``: the control's and the test's metrics, to check the replay against.
    """
    first, _ = _probe_step(pair, pair_dir, runner, 1)
    if divergent_step is not None:
        first["first_divergent_step"] = divergent_step
    if divergent_step is None or divergent_step <= 1 or not agrees(first):
        return first
    later, paths = _probe_step(pair, pair_dir, runner, divergent_step)
    head: dict[str, Any] = {"first_divergent_step": divergent_step, "step_1_agrees": True}
    if paths and runs:
        head["replay_loss_max_abs_diff"] = replay_deviation(paths, runs, divergent_step)
    # Scalars first (the failure message prints them in order), then the tables.
    return {
        **{k: v for k, v in later.items() if not isinstance(v, list)},
        **head,
        **{k: v for k, v in later.items() if isinstance(v, list)},
    }

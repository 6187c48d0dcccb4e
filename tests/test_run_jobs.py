"""The job level (convergence/run/jobs.py) on its own: a JobRunner runs a job through the real
launcher and the run cache with no pair, no rules and no verdict -- what the numerics probe,
a resuming side and ``convergence ab`` build on. The job is a command-backend script started
directly (no torchrun: the launcher runs it with this Python), so each run costs a Python
start."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from convergence.preflight import load_checked
from convergence.run.jobs import JobRunner, RunSettings
from convergence.spec.job import JobSpec
from experiments import command_pair

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
TRAINER = """
import json, sys
from pathlib import Path

dump, steps = Path(sys.argv[1]), int(sys.argv[2])
dump.mkdir(parents=True, exist_ok=True)
with (dump / "log.jsonl").open("w") as log:
    for step in range(1, steps + 1):
        log.write(json.dumps({"step": step, "train_loss": 4.0 / step, "gnorm": 1.0}) + "\\n")
"""


def _job(folder: Path) -> JobSpec:
    (folder / "trainer.py").write_text(TRAINER)
    path = command_pair(
        folder,
        command=[str(folder / "trainer.py"), "{dump_dir}", "{steps}"],
        steps=STEPS,
        backend_options={"launch": "direct"},
    )
    return load_checked(path, rootdir=ROOT).pairs[0].control


def test_a_job_runs_once_then_comes_from_the_run_cache(tmp_path: Path) -> None:
    job = _job(tmp_path)
    runner = JobRunner(RunSettings(work_dir=tmp_path / "work", devices=1))
    pair_dir = tmp_path / "work" / "runs" / "p"
    first = runner.run_job("control", job, pair_dir=pair_dir, cacheable=True)
    again = runner.run_job("control", job, pair_dir=pair_dir, cacheable=True)
    assert (first.cached, again.cached) == (False, True)
    assert first.metrics["loss"].steps.tolist() == [1, 2, 3]
    assert again.metrics["loss"].values.tolist() == first.metrics["loss"].values.tolist()
    assert len(list(pair_dir.glob("control-*"))) == 1  # one launch: the second was a hit


def test_prepare_works_a_job_out_once_per_session(tmp_path: Path) -> None:
    job = _job(tmp_path)
    runner = JobRunner(RunSettings(work_dir=tmp_path / "work", devices=1))
    prepared = runner.prepare(job)
    assert runner.prepare(job) is prepared  # not recomputed: the same object
    assert prepared.key == runner.job_key(job, prepared.backend, prepared.seed_dir)
    other = runner.prepare(dataclasses.replace(job, seed=job.seed + 1))
    assert other.key != prepared.key


def test_the_job_tier_and_its_users_load_no_pair_tier() -> None:
    """At run time too (tests/test_layers.py checks the imports): the probe, a resuming side
    and ``convergence ab`` never load the pair level."""
    code = (
        "import sys, convergence.run.jobs, convergence.run.probe, convergence.run.resume, "
        "convergence.cli.ab; print(sorted(m for m in sys.modules if m in "
        "('convergence.run.runner', 'convergence.run.session')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"

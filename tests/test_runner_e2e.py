"""The library end to end on CPU/gloo: real torchrun, the built-in trainer, real verdicts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from convergence.preflight import load_checked
from convergence.run.runner import Runner, RunSettings
from experiments import builtin_pair, command_pair, fixture_command

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("runner_e2e")

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).parent / "fixtures" / "hooks"
STEPS = 8


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    # The hook module must import in the trainer's ranks: put its folder on their PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p
    )
    sys.path.insert(0, str(HOOKS))
    work = tmp_path_factory.mktemp("work")
    return Runner(RunSettings(work_dir=work, idle_limit_s=120, wall_limit_s=600))


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = builtin_pair(
        tmp_path_factory.mktemp("exp"),
        file="e2e.toml",
        steps=STEPS,
        seed=3,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            {"name": "ddp2", "parallelism": {"dp_replicate": 2}},
            {
                "name": "fsdp2-bug",
                "parallelism": {"dp_shard": 2},
                "hook": "planted_bugs:double_ffn_grad",
                "steps": 40,
                "probe": "off",  # localisation has its own tests (test_probe.py)
            },
        ],
    )
    exp = load_checked(path, rootdir=ROOT)
    return {p.name: p for p in exp.pairs}


def test_correct_pair_passes_and_control_is_cached(
    runner: Runner, experiment: dict[str, object]
) -> None:
    outcome = runner.run_pair(experiment["ddp2"])  # type: ignore[arg-type]
    assert outcome.status == "passed", outcome.error or [v.message for v in outcome.verdicts]
    loss = outcome.verdict("loss")
    assert loss is not None and loss.steps_compared == STEPS
    assert loss.max_deviation < 1e-4
    assert outcome.control is not None and not outcome.control.cached
    # The same control again: taken from the run cache, not rerun.
    again = runner.run_pair(experiment["ddp2"])  # type: ignore[arg-type]
    assert again.control is not None and again.control.cached
    assert again.status == "passed"


@pytest.mark.rounding
def test_planted_bug_fails_with_first_divergent_step(
    runner: Runner, experiment: dict[str, object]
) -> None:
    outcome = runner.run_pair(experiment["fsdp2-bug"])  # type: ignore[arg-type]
    assert outcome.status == "failed"
    grad = outcome.verdict("grad_norm")
    assert grad is not None and not grad.passed
    assert grad.first_divergent_step == 1  # the doubled gradient shows at the first step
    # Early stopping ended the hopeless test long before its 40 steps; the verdict is judged on
    # the steps that ran, so the (bit-identical under Adam) loss is not failed for stopping.
    assert outcome.stopped_early_at is not None and outcome.stopped_early_at < 20
    loss = outcome.verdict("loss")
    assert loss is not None and loss.passed, loss.message
    # No process of the jobs outlives them (the session's warm-start servers live on by design;
    # whatever they forked for a job must not).
    me = psutil.Process()
    servers = runner.jobs.launcher.fork_servers.pids()  # type: ignore[attr-defined]
    assert not [
        c
        for c in me.children(recursive=True)
        if c.pid not in servers and c.is_running() and c.status() != psutil.STATUS_ZOMBIE
    ]


def test_command_backend_pair(runner: Runner, tmp_path: Path) -> None:
    path = command_pair(
        tmp_path,
        command=fixture_command(),
        steps=6,
        compare=None,
        control={"name": "ddp1", "parallelism": {"dp_replicate": 1}, "local_batch_size": 2},
        tests=[
            {"name": "ddp2", "parallelism": {"dp_replicate": 2}, "local_batch_size": 1},
            {
                "name": "ddp2-bug",
                "parallelism": {"dp_replicate": 2},
                "local_batch_size": 1,
                "backend_options": {"command": fixture_command("--grad-scale 2")},
                "early_stop": False,
            },
        ],
    )
    pairs = {p.name: p for p in load_checked(path, rootdir=ROOT).pairs}
    good = runner.run_pair(pairs["ddp2"])
    assert good.status == "passed", good.error or [v.message for v in good.verdicts]
    bad = runner.run_pair(pairs["ddp2-bug"])
    assert bad.status == "failed"
    assert bad.verdict("loss") is not None and not bad.verdict("loss").passed

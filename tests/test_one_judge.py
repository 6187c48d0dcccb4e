"""One judge: the same two curves get the same verdict through every front end -- the library's
``judge()``, the Runner (pytest, ``convergence run``, ``bisect`` and the nightly run pairs
through it), ``convergence compare`` and ``convergence ab`` -- with this stack's calibration
file present and absent.

The curves are replayed by a command "trainer" that copies a JSONL file into its dump folder
(real jobs, real git worktrees for ``ab``); the test's loss is 1e-4 above the control's from
step 3 on: outside the shipped CPU defaults' paired tolerance, inside a noisier calibration's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from convergence.calibration.file import Calibration, write_calibration
from convergence.calibration.select import DEFAULTS, current, select_calibration
from convergence.calibration.stack import current_stack, stack_hash
from convergence.cli import main
from convergence.cli.ab import run_ab
from convergence.metrics.reader import read_run
from convergence.options import run_settings
from convergence.preflight import load_checked
from convergence.run.judge import judge
from convergence.run.runner import Runner, RunSettings
from convergence.stats.types import MetricVerdict
from convergence.worktrees import git
from experiments import write_experiment, write_toml

pytestmark = pytest.mark.xdist_group("one_judge")  # its module-scoped runs stay on one worker

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
NOISY = {"loss": {"atol": 1e-3, "growth": 0.1, "rtol": 1e-6}}

REPLAY = """\
import shutil, sys
from pathlib import Path
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
shutil.copy(sys.argv[1], out / "metrics.jsonl")
"""


def _curve(path: Path, *, shift: float) -> Path:
    lines = [
        {
            "step": s,
            "loss": 3.0 * 0.95**s + 1.0 + (shift if s >= 3 else 0.0),
            "grad_norm": 1.0 / s,
        }
        for s in range(1, STEPS + 1)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _job(curve: str) -> dict[str, Any]:
    return {
        "backend": "command",
        "backend_options": {
            "command": ["replay.py", curve, "{dump_dir}"],
            "launch": "direct",
        },
    }


def _signature(verdicts: tuple[MetricVerdict, ...]) -> list[tuple[Any, ...]]:
    """What a verdict says, per metric: pass, gate, tolerance text, first divergent step,
    whose floors (in metric order: a front end may list the rules in another order)."""
    return sorted(
        (
            v.metric,
            v.passed,
            v.gate,
            v.tolerance,
            v.first_divergent_step,
            v.details.get("floors", {}).get("source"),
        )
        for v in verdicts
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The replay trainer and both curves; a git repository whose main holds the control's
    curve and whose branch "moved" holds the test's (for ``ab``)."""
    root = tmp_path_factory.mktemp("one_judge")
    (root / "replay.py").write_text(REPLAY)
    (root / "cfg.toml").write_text("# hashed only\n")
    _curve(root / "control.jsonl", shift=0.0)
    _curve(root / "test.jsonl", shift=1e-4)
    write_experiment(
        root,
        defaults={"train_config": "cfg.toml", "steps": STEPS, "early_stop": False},
        control={"name": "control", **_job("control.jsonl")},
        tests=[{"name": "test", **_job("test.jsonl")}],
    )
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    (repo / "replay.py").write_text(REPLAY)
    (repo / "cfg.toml").write_text("# hashed only\n")
    _curve(repo / "curve.jsonl", shift=0.0)
    job = {"name": "job", **_job("curve.jsonl")}
    write_toml(
        repo / "exp.toml",
        {"defaults": {"train_config": "cfg.toml", "steps": STEPS}, "control": job, "test": [job]},
    )
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "control curve")
    git(repo, "checkout", "-q", "-b", "moved")
    _curve(repo / "curve.jsonl", shift=1e-4)
    git(repo, "commit", "-q", "-am", "the test curve")
    git(repo, "checkout", "-q", "main")
    return root


@pytest.mark.parametrize("calibrated", [False, True], ids=["defaults", "calibration"])
def test_the_same_curves_get_the_same_verdict_through_every_front_end(
    project: Path,
    tmp_path: Path,
    calibrated: bool,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CONVERGENCE_CALIBRATION", raising=False)
    work = tmp_path / "work"
    if calibrated:
        stack = current_stack()
        write_calibration(
            Calibration(stack_hash=stack_hash(stack), stack=stack, paired=NOISY),
            work / "calibration" / f"{stack_hash(stack)}.json",
        )
    (pair,) = load_checked(project / "exp.toml", rootdir=project).pairs

    # The library's judge on the curves as files.
    control_run, test_run = read_run(project / "control.jsonl"), read_run(project / "test.jsonl")
    direct = judge(pair, [control_run], test_run, select_calibration(work))
    assert direct.passed is calibrated  # the calibration decides: it was really applied
    expected = _signature(direct.verdicts)
    loss = {v.metric: v for v in direct.verdicts}["loss"]
    assert loss.details["floors"]["source"] == ("calibration" if calibrated else "defaults")

    # The Runner: both sides launched as jobs (a relative command runs from the cwd).
    monkeypatch.chdir(project)
    outcome = Runner(RunSettings(work_dir=work, early_stop=True)).run_pair(pair)
    # The calibration is handed to the judge and the early-stop monitor, never made the
    # process's: after the Runner, the process holds what it held before.
    assert current() is DEFAULTS
    assert outcome.status == ("passed" if calibrated else "failed"), outcome.error
    assert _signature(outcome.verdicts) == expected

    # `convergence compare` on the same files.
    code = main(["compare", "control.jsonl", "test.jsonl", "--workdir", str(work)])
    out = capsys.readouterr().out
    assert code == (0 if calibrated else 1), out
    assert loss.message in out  # its tolerance figures: the calibration's or the defaults'

    # `convergence ab`: the control's curve on main, the test's on the branch.
    monkeypatch.chdir(project / "repo")
    settings = run_settings({}, work_dir=work / "ab")
    if calibrated:  # ab's calibration is the one under its own workdir
        (work / "ab").mkdir()
        (work / "calibration").rename(work / "ab" / "calibration")
    outcomes = run_ab(
        project / "repo" / "exp.toml",
        baseline="main",
        candidate="moved",
        repo=project / "repo",
        settings=settings,
        rootdir=project / "repo",
    )
    assert [o.pair.control.name for o in outcomes] == ["job"]
    assert outcomes[0].status == outcome.status, outcomes[0].error
    assert _signature(outcomes[0].verdicts) == expected


def test_only_the_judge_makes_a_verdict() -> None:
    """``compare_all`` (the comparisons, stats/registry.py) is called by run/judge.py alone:
    a front end that called it would judge without the calibration note or the golden note."""
    callers = []
    for path in sorted((REPO / "convergence").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("compare_all"):
                callers.append(str(path.relative_to(REPO)))
    assert set(callers) == {"convergence/run/judge.py"}, callers


def test_only_settle_makes_a_status() -> None:
    """A status from verdicts is settled in run/settle.py alone, and the front ends build
    their outcome's status from it: a front end with its own rule (NaN, not compared, an
    unreliable reference) would tell the same verdicts another status."""
    callers = []
    for path in sorted((REPO / "convergence").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("status_of"):
                callers.append(str(path.relative_to(REPO)))
    assert set(callers) == {"convergence/run/settle.py"}, callers
    for front_end in ("run/runner.py", "cli/compare.py", "cli/ab.py"):
        assert "settle(" in (REPO / "convergence" / front_end).read_text(), front_end

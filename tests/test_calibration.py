"""``convergence calibrate`` and the floors a verdict uses (convergence/calibration/).

The fast tests run a real pair (fp32, debug model, 4 steps) through a real pytest session in a
temporary project, with and without a calibration file for this machine's stack: a small,
smooth perturbation of the test (layer 0's output scaled by 1 + 1e-3) fails the shipped floors,
passes under the floors of a noisier stack, and a calibration for another stack is not used --
each report says which floors it used. The control is cached across the module's sessions,
so after the first only the test job runs. The whole ``convergence calibrate`` run, then a
session that uses what it wrote, is slow-marked (~2 min on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convergence.calibration.file import Calibration, load_calibration, write_calibration
from convergence.calibration.measure import paired_floor, twin_floor
from convergence.calibration.select import (
    DEFAULTS,
    calibrated,
    current,
    select_calibration,
    use,
)
from convergence.calibration.stack import current_stack, stack_hash
from convergence.metrics.curve import Curve
from convergence.metrics.reader import read_run
from convergence.nightly.sbatch import NightlySettings, render_sbatch
from convergence.regimes import REGISTRY
from convergence.spec.errors import SpecError
from convergence.spec.pair import ComparisonRule
from convergence.stats.paired_band import PAIRED_DEFAULTS, paired_tolerance
from convergence.stats.registry import compare_all
from convergence.stats.twin_envelope import TWIN_DEFAULTS, TwinEnvelope, twin_noise
from convergence.stats.types import MetricVerdict
from experiments import builtin_pair

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # report_examples
# Its sessions share one project (module fixture): one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("calibration")

CONFIG = REPO / "train_configs" / "debug.toml"

NUDGE = '''
from torch import nn


def nudge_layer0(model: nn.Module, ctx) -> None:
    """Layer 0's output scaled by 1 + 1e-3: a small, smooth change of the forward (what a
    kernel that rounds differently might do), far below any real bug."""
    layers = getattr(model, "layers", None)
    if layers is None or "0" not in layers:
        return None
    layers["0"].register_forward_hook(lambda module, args, output: output * (1 + 1e-3))
    return None
'''


#: A stack whose fp32 reductions are 100x noisier than this CPU's (a simulated GPU).
NOISY = {
    "loss": {"atol": 1e-3, "growth": 0.1, "rtol": 1e-6},
    "grad_norm": {"atol": 1e-7, "growth": 0.1, "rtol": 1e-2},
    "grad_norm_parts": {"atol": 1e-7, "growth": 0.1, "rtol": 1e-2},
}


@pytest.fixture(autouse=True)
def _defaults_after() -> object:
    yield
    use(DEFAULTS)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("calibrated-project")
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "nudge.py").write_text(NUDGE)
    builtin_pair(
        root / "experiments",
        file="pair.toml",
        train_config=str(CONFIG),
        steps=4,
        seed=3,
        probe="off",
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            {
                "name": "nudged",
                "parallelism": {"dp_shard": 2},
                "hook": "nudge:nudge_layer0",
                "early_stop": False,
            }
        ],
    )
    return root


def _session(project: Path, tag: str, env: dict[str, str] | None = None) -> tuple[str, dict]:  # type: ignore[type-arg]
    """One pytest session on the project; (stdout, report.json)."""
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(project)])}
    run_env.pop("CONVERGENCE_CALIBRATION", None)
    run_env.update(env or {})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-m",
            "convergence",
            "--convergence-report",
            f"report-{tag}",
            "--junitxml",
            f"junit-{tag}.xml",
        ],
        cwd=project,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((project / f"report-{tag}" / "report.json").read_text())
    return done.stdout + done.stderr, report


def _verdicts(report: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    (pair,) = report["pairs"]
    return {v["metric"]: v for v in pair["verdicts"]}


def _calibration(stack: dict, paired: dict) -> Calibration:  # type: ignore[type-arg]
    return Calibration(
        stack_hash=stack_hash(stack),
        stack=stack,
        paired=paired,
        obtained={"source": "written by a test", "date": "2026-11-25T00:00:00+00:00"},
    )


def _judge_again(project: Path) -> dict[str, MetricVerdict]:
    """The session's own curves judged again in this process, with the paired regime's
    default rules (the pair's), under whatever calibration this process has selected."""
    (folder,) = (project / ".convergence" / "runs").iterdir()
    control = read_run(next(folder.glob("control-*")))
    test = read_run(next(folder.glob("test-*")))
    rules = REGISTRY.default_rules("paired")
    return {v.metric: v for v in compare_all(rules, [control], test)}


def test_a_calibration_of_a_noisier_stack_turns_the_fail_into_a_pass(project: Path) -> None:
    """One session with the noisier stack's calibration in place: the pair passes and every
    report names the file. The same curves, judged with the shipped floors, fail."""
    path = project / ".convergence" / "calibration" / f"{stack_hash(current_stack())}.json"
    write_calibration(_calibration(current_stack(), NOISY), path)
    try:
        out, report = _session(project, "noisy")
        assert report["pairs"][0]["status"] == "passed", out
        selection = use(select_calibration(project / ".convergence"))
        assert selection.path == path
        calibrated_again = _judge_again(project)
    finally:
        path.unlink()
    verdicts = _verdicts(report)
    for metric in ("loss", "grad_norm", "grad_norm_parts"):
        assert "floors calibrated on this stack" in verdicts[metric]["tolerance"]
    assert "rtol 0.01" in verdicts["grad_norm_parts"]["tolerance"]
    assert f"noise floors from calibration {path}" in out
    md = (project / "report-noisy" / "report.md").read_text()
    assert "noise floors from calibration" in md and path.name in md
    html = (project / "report-noisy" / "report.html").read_text()
    assert "floors from calibration" in html
    junit = (project / "junit-noisy.xml").read_text()
    assert f'name="convergence.floors" value="floors from calibration {path}' in junit
    # The same curves in this process: a pass with the calibration, a fail without it.
    assert calibrated_again["grad_norm_parts"].passed
    use(DEFAULTS)
    shipped = _judge_again(project)
    assert not shipped["grad_norm_parts"].passed, shipped["grad_norm_parts"].message
    assert shipped["grad_norm_parts"].max_deviation == pytest.approx(
        verdicts["grad_norm_parts"]["max_deviation"]
    )


@pytest.mark.slow
def test_shipped_defaults_fail_the_nudge_and_say_so(project: Path) -> None:
    """The whole default path: no calibration file, a session, the fail and its note."""
    out, report = _session(project, "defaults")
    assert report["pairs"][0]["status"] == "failed", out
    verdicts = _verdicts(report)
    assert not verdicts["grad_norm_parts"]["passed"]
    assert "[floors: shipped CPU defaults]" in verdicts["grad_norm_parts"]["tolerance"]
    assert "noise floors: shipped CPU defaults (no calibration for stack" in out
    junit = (project / "junit-defaults.xml").read_text()
    assert 'name="convergence.floors" value="floors: shipped CPU defaults' in junit


def test_a_calibration_of_another_stack_is_not_used_and_every_report_says_so(
    tmp_path: Path,
) -> None:
    """No jobs: the selection and what each report shows of it, on a real verdict."""
    from report_examples import passing_pair

    from convergence.report import build_report, render_markdown
    from convergence.report.formats.junit import junit_properties
    from convergence.report.formats.terminal import render_summary
    from convergence.run.judge import with_calibration_note

    other = {**current_stack(), "hardware": "cuda:NVIDIA H100 80GB HBM3"}
    path = tmp_path / "h100.json"
    write_calibration(_calibration(other, NOISY), path)
    # Named by $CONVERGENCE_CALIBRATION (explicit), or copied to this stack's default place.
    selection = select_calibration(tmp_path, explicit=path)
    assert selection.calibration is None
    assert f"calibration {path} is for another stack (hardware" in selection.describe()
    copied = tmp_path / "calibration" / f"{stack_hash(current_stack())}.json"
    copied.parent.mkdir()
    copied.write_text(path.read_text())
    selection = use(select_calibration(tmp_path))
    assert selection.calibration is None and "is for another stack" in selection.describe()
    assert (
        paired_tolerance(ComparisonRule(metric="loss", method="paired"))
        == (PAIRED_DEFAULTS["loss"])
    )
    outcome = passing_pair()
    outcome = dataclasses.replace(
        outcome, verdicts=with_calibration_note(outcome.verdicts, selection)
    )
    loss = outcome.verdict("loss")
    assert loss is not None and loss.tolerance.endswith("[floors: shipped CPU defaults]")
    assert loss.details["floors"]["source"] == "defaults"
    props = dict(junit_properties(outcome))
    assert "is for another stack" in props["convergence.floors"]
    assert "noise floors: shipped CPU defaults (calibration" in render_summary([outcome])
    doc = build_report([outcome], environment={}, started_at=None, wall_s=None)
    assert "cuda:NVIDIA H100" in doc["environment"]["noise_floors"]
    assert "is for another stack" in render_markdown(doc)


# -- no jobs -------------------------------------------------------------------------------


def test_the_file_round_trips_and_a_bad_one_is_named(tmp_path: Path) -> None:
    stack = current_stack()
    path = write_calibration(_calibration(stack, NOISY), tmp_path / "c.json")
    assert load_calibration(path).paired == NOISY
    data = json.loads(path.read_text())
    data["paired"]["loss"]["rtol"] = "big"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"c\.json: key 'paired\.loss\.rtol': must be a number"):
        load_calibration(path)
    # select_calibration never raises: the verdicts fall back to the defaults and say why.
    selection = select_calibration(tmp_path, explicit=path)
    assert selection.calibration is None and "not used" in selection.describe()


def test_calibrated_replaces_only_the_calibrated_values(tmp_path: Path) -> None:
    rule = ComparisonRule(metric="loss", method="paired")
    assert paired_tolerance(rule) == PAIRED_DEFAULTS["loss"]
    path = write_calibration(
        _calibration(current_stack(), {"loss": {"atol": 5e-4}}),
        tmp_path / "calibration" / f"{stack_hash(current_stack())}.json",
    )
    selection = use(select_calibration(tmp_path))
    assert selection.calibration is not None and selection.path == path
    assert current() is selection
    tol = paired_tolerance(rule)
    assert (tol.atol, tol.growth, tol.rtol) == (5e-4, 0.1, 1e-6)
    assert (
        paired_tolerance(ComparisonRule(metric="loss", method="paired", atol=1e-9)).atol == 1e-9
    )  # rule wins
    assert (
        calibrated("paired", "grad_norm", PAIRED_DEFAULTS["grad_norm"])
        == (PAIRED_DEFAULTS["grad_norm"])
    )


def _curve(values: list[float], metric: str = "loss") -> Curve:
    return Curve(metric, np.arange(1, len(values) + 1), np.asarray(values, dtype=np.float64))


def test_paired_floor_covers_the_worst_layout_with_margin_and_keeps_the_defaults_floor() -> None:
    control = _curve([5.0, 4.0, 3.0, 2.0])
    noisy = _curve([5.0 + 1e-4, 4.0, 3.0 - 2e-4, 2.0])
    default = {"atol": 1e-5, "growth": 0.1, "rtol": 1e-6}
    values, raw = paired_floor(control, [noisy], default, margin=2.0)
    assert raw["max_abs_diff"] == pytest.approx(2e-4)
    expected = (2 * 2e-4 - 1e-6 * 3.0) / (1 + 0.1 * np.sqrt(3))
    assert values["atol"] == pytest.approx(expected)
    quiet, _ = paired_floor(control, [control], default, margin=2.0)
    assert quiet == default  # a quieter stack keeps the validated defaults


def test_twin_floor_gives_the_k_and_rtol_the_layouts_needed() -> None:
    control = _curve([5.0, 4.0, 3.0, 2.0])
    twin = _curve([5.0, 4.0 + 1e-3, 3.0, 2.0])  # noise 0 at step 1, then 1e-3 (running max)
    test = _curve([5.0 + 5e-4, 4.0 + 2e-3, 3.0 + 4e-3, 2.0])
    default = {"k": 3.0, "atol": 0.0, "growth": 0.0, "rtol": 2e-5}
    # pool 0: step 1 keeps the twin's 0 (the verdict pools the next steps in; see below).
    values, raw = twin_floor(control, twin_noise(control, [twin]), [test], default, margin=2.0)
    assert raw["rtol_needed"] == pytest.approx(2 * 5e-4 / 5.0)  # step 1: only the floor covers
    rtol = values["rtol"]
    assert raw["k_needed"] == pytest.approx((4e-3 - rtol * 3.0) / 1e-3)
    assert values["k"] == pytest.approx(2 * raw["k_needed"])


def test_twin_floor_measures_k_on_the_verdicts_own_envelope() -> None:
    # Two twins, each one source of noise (1e-3 and 2e-3 by step 2): the verdict's envelope
    # is k x their sum, pooled two steps ahead, so the k calibrated is the k it needs on that.
    control = _curve([5.0, 4.0, 3.0, 2.0])
    dp = _curve([5.0, 4.0 + 1e-3, 3.0, 2.0])
    forward = _curve([5.0, 4.0, 3.0 - 2e-3, 2.0])
    test = _curve([5.0, 4.0 + 2e-3, 3.0 + 9e-3, 2.0])
    default = {"k": 3.0, "atol": 0.0, "growth": 0.0, "rtol": 0.0}
    noise = twin_noise(control, [dp, forward], pool=TWIN_DEFAULTS["loss"].pool)
    assert noise[1].tolist() == pytest.approx([3e-3, 3e-3, 3e-3, 3e-3])
    values, raw = twin_floor(control, noise, [test], default, margin=2.0)
    assert raw["k_needed"] == pytest.approx(3.0) and values["k"] == pytest.approx(6.0)
    rule = ComparisonRule(metric="loss", method="twin", z=raw["k_needed"] * 1.01)
    assert TwinEnvelope().compare(rule, [control, dp, forward], test).passed
    tight = ComparisonRule(metric="loss", method="twin", z=raw["k_needed"] * 0.99)
    assert not TwinEnvelope().compare(tight, [control, dp, forward], test).passed


def test_calibrate_if_missing_does_nothing_when_this_stack_has_one(tmp_path: Path) -> None:
    write_calibration(
        _calibration(current_stack(), NOISY),
        tmp_path / "calibration" / f"{stack_hash(current_stack())}.json",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CONVERGENCE_CALIBRATION", None)
    done = subprocess.run(
        [sys.executable, "-m", "convergence.cli", "calibrate", "--if-missing", "debug"]
        + ["--workdir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "nothing to do" in done.stdout
    assert not (tmp_path / "calibration" / "runs").exists()  # no job was run


def test_the_nightly_script_calibrates_before_pytest_when_asked() -> None:
    settings = NightlySettings(experiments=("experiments",), out="/out")
    text = render_sbatch(settings)
    calibrate = text.index("-m convergence.cli calibrate --if-missing debug")
    assert calibrate < text.index("-m pytest -m convergence")
    off = render_sbatch(NightlySettings(experiments=("experiments",), out="/out", calibrate=None))
    assert "calibrate" not in off.split("export MPLBACKEND")[1]


@pytest.mark.rounding
@pytest.mark.slow
def test_calibrate_writes_a_file_that_the_next_session_uses(project: Path) -> None:
    """The whole command on the debug config (few steps, one layout each), then a session."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(project)])}
    env.pop("CONVERGENCE_CALIBRATION", None)
    done = subprocess.run(
        [sys.executable, "-m", "convergence.cli", "calibrate", "debug", "--steps", "4"]
        + ["--fp32-layouts", "ddp2", "--bf16-layouts", "fsdp4"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    path = project / ".convergence" / "calibration" / f"{stack_hash(current_stack())}.json"
    assert f"written to {path}" in done.stdout
    written = load_calibration(path)
    assert set(written.paired) >= {"loss", "grad_norm", "grad_norm_parts", "val_loss"}
    assert set(written.twin) >= {"loss", "grad_norm", "grad_norm_parts"}
    assert written.obtained["steps"] == 4 and written.obtained["fp32_layouts"] == ["ddp2"]
    try:
        out, report = _session(project, "calibrated")
    finally:
        path.unlink()
    assert f"noise floors from calibration {path}" in out
    assert "floors calibrated on this stack" in _verdicts(report)["loss"]["tolerance"]

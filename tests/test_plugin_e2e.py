"""The plugin end to end on CPU/gloo: real torchrun, the built-in trainer, real verdicts.

Each test is one or two pytest sessions in a subprocess (pytester), 8 steps of the debug model
on 2 ranks per job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import builtin_pair

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug.toml"

# The planted bug lives in the test project's own folder (the ranks import it from their cwd).
GRAD_BUG = '''
from torch import nn


def double_ffn_grad(model: nn.Module, ctx) -> None:
    """The gradient flowing into layer 0 is doubled (a wrongly scaled reduction): the
    forward is untouched, the gradients of layer 0 and the embedding are 2x.

    A hook on an activation, not on a parameter: FSDP2 writes the sharded parameters'
    gradients directly, so a tensor hook on them would never run."""
    layers = getattr(model, "layers", None)
    if layers is None or "0" not in layers:
        return None

    def double_grad(module, args, output):
        output.register_hook(lambda grad: 2 * grad)

    layers["0"].register_forward_hook(double_grad)
    return None
'''

DDP2 = {"name": "ddp2", "parallelism": {"dp_replicate": 2}}
BUG = {
    "name": "fsdp2-bug",
    "parallelism": {"dp_shard": 2},
    "hook": "grad_bug:double_ffn_grad",
    "early_stop": False,
}


def write_pairs(project: pytest.Pytester, *tests: dict[str, object]) -> None:
    """experiments/pairs.toml: an FSDP control on 2 ranks (8 steps, seed 3) and ``tests``."""
    builtin_pair(
        project.path / "experiments",
        file="pairs.toml",
        train_config=str(CONFIG),
        steps=8,
        seed=3,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=tests,
    )


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(grad_bug=GRAD_BUG)
    return pytester


def _saved_outcomes(project: pytest.Pytester) -> list[dict]:  # type: ignore[type-arg]
    sessions = sorted((project.path / ".convergence" / "sessions").iterdir())
    return [json.loads(p.read_text()) for p in sorted(sessions[-1].glob("*.outcome.json"))]


def test_toml_pairs_under_xdist_share_one_control(project: pytest.Pytester) -> None:
    import jsonschema

    from convergence.report import REPORT_JSON_SCHEMA

    write_pairs(project, DDP2, BUG)
    result = project.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-m",
        "convergence",
        "-n",
        "2",
        "--convergence-report",
        "report",
        "--junitxml",
        "junit.xml",
        timeout=540,
    )
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    # The planted bug: the grad norm is off from the first step; the failure says where.
    result.stdout.fnmatch_lines(
        [
            "*pairs.toml::fsdp2-bug: grad_norm diverges from step 1*",
            "*grad_norm around the divergence:*",
            "*step*control*test*Δ*",
        ]
    )
    assert "PASSED experiments/pairs.toml::ddp2" in out or "1 passed" in out
    # The matrix, once, from the controller.
    assert out.count("convergence matrix (2 pairs)") == 1
    # The shared control ran once: one fresh control run, the other pair took it from the cache.
    saved = _saved_outcomes(project)
    assert len(saved) == 2
    fresh_controls = [o for o in saved if not o["control"]["cached"]]
    assert len(fresh_controls) == 1
    control_runs = list((project.path / ".convergence" / "runs").glob("*/control-*"))
    assert len(control_runs) == 1, control_runs
    # Report files, valid against the schema.
    report = json.loads((project.path / "report" / "report.json").read_text())
    jsonschema.validate(report, REPORT_JSON_SCHEMA)
    assert {p["status"] for p in report["pairs"]} == {"passed", "failed"}
    assert (project.path / "report" / "report.html").stat().st_size > 1000
    # The failure text points at the pair's plot, which the controller wrote at the end.
    plot = project.path / "report" / "plots" / "pairs.toml_fsdp2-bug.png"
    assert f"plot: {plot}" in out and plot.stat().st_size > 1000
    assert 'name="convergence.status" value="failed"' in (project.path / "junit.xml").read_text()


PY_API = f"""
import pytest

LAYOUTS = {{"ddp2": {{"dp_replicate": 2}}}}

@pytest.mark.convergence(train_config={str(CONFIG)!r}, steps=8, seed=3)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layouts(convergence_pair, layout):
    outcome = convergence_pair(control={{"name": "fsdp2", "parallelism": {{"dp_shard": 2}}}},
                               test={{"parallelism": layout}})
    assert outcome.verdict("loss").steps_compared == 8


def test_not_a_convergence_test():
    pass
"""


def test_python_api_progress_and_cached_control(project: pytest.Pytester) -> None:
    from convergence.cache.key import sources_hash

    package = REPO / "convergence"
    code_before = sources_hash(package)
    project.makepyfile(test_api=PY_API)
    result = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "-m", "convergence", timeout=540
    )
    result.assert_outcomes(passed=1, deselected=1)
    # Live progress (not a tty here), no rank logs. Which steps show depends on the launcher's
    # progress throttle and the machine's speed; the control shows some step, and the test's
    # last step is always shown (the launcher forces a final progress event).
    result.stdout.fnmatch_lines(
        [
            "[[]fsdp2 control[]] starting (2 ranks, local launcher, warm)",
            "[[]fsdp2 control[]] step */8 loss *",
            "[[]test_layouts[[]ddp2[]] test[]] step 8/8 loss * ETA 0:00",
        ]
    )
    assert "Traceback" not in result.stdout.str()
    assert _saved_outcomes(project)[0]["control"]["cached"] is False
    # Second session: the control comes from the run cache (keyed by the library's sources).
    if sources_hash(package) != code_before:
        pytest.skip("the convergence sources changed during the test: new cache key")
    result = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "-m", "convergence", timeout=540
    )
    result.assert_outcomes(passed=1, deselected=1)
    assert "[fsdp2 control]" not in result.stdout.str()
    assert _saved_outcomes(project)[0]["control"]["cached"] is True


@pytest.mark.slow
def test_ctrl_c_stops_jobs_and_writes_a_partial_report(project: pytest.Pytester) -> None:
    """SIGINT (Ctrl-C) while a job runs: pytest ends as interrupted, no process of the jobs
    is left, and the report holds the pairs that finished and the one in flight (interrupted)."""
    import signal
    import subprocess
    import sys

    import psutil

    long = {"name": "ddp2-long", "parallelism": {"dp_replicate": 2}, "steps": 100000}
    write_pairs(project, DDP2, {**long, "early_stop": False})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-m",
            "convergence",
            "--convergence-report",
            "report",
        ],
        cwd=project.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a shell's `&` leaves SIGINT ignored, and Python keeps that: restore a terminal's
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # wait until the long job is training
        lines.append(line)
        if line.startswith("[ddp2-long test] step"):
            break
    descendants = psutil.Process(proc.pid).children(recursive=True)
    assert descendants
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == pytest.ExitCode.INTERRUPTED, out
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not [p for p in alive if p.status() != "zombie"], out
    report = json.loads((project.path / "report" / "report.json").read_text())
    assert [(p["name"], p["status"]) for p in report["pairs"]] == [
        ("ddp2", "passed"),
        ("ddp2-long", "error"),
    ]
    assert "interrupted (Ctrl-C)" in report["pairs"][1]["error"]
    assert report["environment"]["interrupted"] is True

"""The numerics probe: comparison rules (plain Python) and, end to end on CPU/gloo, that a
planted bug in one layer's TP plan is named by the probe through Runner.run_pair, and that a
bug invisible at step 1 is named by a probe at the first divergent step."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from convergence.preflight import load_checked
from convergence.run.probe_compare import (
    compare_probe_files,
    compare_probes,
    load_probe,
    summary_items,
)
from convergence.spec.errors import SpecError
from experiments import builtin_pair

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("probe")

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).parent / "fixtures" / "hooks"
BUGGY_MODULE = "layers.1.attention.wo"


def probe(
    norms: dict[str, float], grads: dict[str, float], *, loss: float = 5.0, dtype: str = "float32"
) -> dict[str, Any]:
    return {
        "version": 1,
        "step": 1,
        "param_dtype": dtype,
        "loss": loss,
        "dp_losses": [loss],
        "modules": [{"name": k, "norm": v, "calls": 1} for k, v in norms.items()],
        "grads": [{"name": k, "norm": v} for k, v in grads.items()],
    }


NORMS = {"tok_embeddings": 250.0, "layers.0.attention.wo": 1.2, "layers.0": 251.0, "output": 40.0}
GRADS = {"tok_embeddings.weight": 3e-2, "layers.0.attention.wo.weight": 2e-4}


def test_fp32_noise_passes_and_first_differing_module_is_named() -> None:
    noisy = {k: v * (1 + 1e-7) for k, v in NORMS.items()}
    same = compare_probes(probe(NORMS, GRADS), probe(noisy, GRADS))
    assert same["module"] is None and same["parameter"] is None
    assert same["modules_differing"] == 0 and same["modules_compared"] == 4
    # Everything from layers.0.attention.wo on is off by 1e-4 relative: wo is named, not the
    # later (also differing) modules; the max |diff| is that module's.
    bad = dict(
        NORMS, **{"layers.0.attention.wo": 1.2 * (1 + 1e-4), "layers.0": 251.1, "output": 40.1}
    )
    loc = compare_probes(
        probe(NORMS, GRADS),
        probe(bad, dict(GRADS, **{"layers.0.attention.wo.weight": 4e-4}), loss=5.1),
    )
    assert loc["module"] == "layers.0.attention.wo"
    assert loc["parameter"] == "layers.0.attention.wo.weight"
    assert loc["max_abs_diff"] == pytest.approx(1.2e-4)
    assert loc["loss_differs"] and loc["modules_differing"] == 3
    assert [r["name"] for r in loc["modules"]] == list(NORMS)  # forward order kept


def test_bf16_tolerance_is_looser_and_the_looser_side_decides() -> None:
    off = {k: v * (1 + 1e-3) for k, v in NORMS.items()}
    assert compare_probes(probe(NORMS, GRADS), probe(off, GRADS))["module"] == "tok_embeddings"
    loc = compare_probes(probe(NORMS, GRADS), probe(off, GRADS, dtype="bfloat16"))
    assert loc["module"] is None and loc["dtype"] == "bfloat16"


def test_unmatched_names_and_summary_leave_out_tables(tmp_path: Path) -> None:
    other = dict(NORMS)
    other["layers.0._odd_wrapper"] = other.pop("layers.0")
    loc = compare_probes(probe(NORMS, GRADS), probe(other, GRADS))
    assert loc["unmatched"] == ["layers.0", "layers.0._odd_wrapper"]
    keys = [k for k, _ in summary_items(loc)]
    assert "modules" not in keys and "unmatched" not in keys and "module" in keys
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"loss": 1.0}))
    with pytest.raises(ValueError, match="is not a probe.json"):
        load_probe(path)
    with pytest.raises(ValueError, match="no probe result"):
        load_probe(tmp_path / "missing.json")


def _experiment(tmp_path: Path, probe_mode: str = "on_failure") -> Path:
    return builtin_pair(
        tmp_path,
        file="probe_e2e.toml",
        steps=4,
        seed=5,
        early_stop=False,
        control={"name": "ddp2", "parallelism": {"dp_replicate": 2}},
        tests=[
            {"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}, "probe": probe_mode},
            {
                "name": "fsdp2-tp2-bug",
                "parallelism": {"dp_shard": 2, "tp": 2},
                "hook": "planted_tp_bugs:tp_without_wo_reduce",
                "hook_mode": "replace_tp",
            },
            {
                "name": "fsdp2-late-bug",
                "parallelism": {"dp_shard": 2},
                "hook": "planted_late_bugs:double_ffn_grad_from_step3",
            },
        ],
    )


def _hooks_on_path() -> None:
    # The hook module must import here (collection checks it) and in the trainer's ranks.
    if str(HOOKS) not in os.environ.get("PYTHONPATH", ""):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p
        )
    if str(HOOKS) not in sys.path:
        sys.path.insert(0, str(HOOKS))


def test_probe_key_is_validated(tmp_path: Path) -> None:
    _hooks_on_path()
    exp = load_checked(_experiment(tmp_path, "always"), rootdir=ROOT)
    pairs = {p.name: p for p in exp.pairs}
    assert pairs["fsdp2-tp2"].probe_always and not pairs["fsdp2-tp2-bug"].probe_always
    with pytest.raises(SpecError, match=r"probe"):
        load_checked(_experiment(tmp_path, "sometimes"), rootdir=ROOT)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from convergence.run.runner import Runner, RunSettings

    _hooks_on_path()
    exp = load_checked(_experiment(tmp_path_factory.mktemp("exp"), "always"), rootdir=ROOT)
    runner = Runner(
        RunSettings(work_dir=tmp_path_factory.mktemp("work"), idle_limit_s=180, wall_limit_s=600)
    )
    return {p.name: runner.run_pair(p) for p in exp.pairs}


def test_full_tensor_norms_agree_between_ddp_and_fsdp_tp(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["fsdp2-tp2"]
    assert outcome.status == "passed", outcome.error
    loc = outcome.localisation
    assert loc is not None and "error" not in loc, loc
    assert loc["module"] is None and loc["parameter"] is None, summary_items(loc)
    # Every module of the model, and every parameter, matched by name across the layouts.
    assert loc["modules_compared"] == 51 and len(loc["parameters"]) == 39
    assert "unmatched" not in loc
    worst = max(r["rel_diff"] for r in loc["modules"] + loc["parameters"])
    assert worst < 1e-6  # local-shard norms would be off by ~30% (half the elements)
    assert loc["dp_losses_control"] == pytest.approx(loc["dp_losses_test"], rel=1e-6)
    assert len(loc["dp_losses_test"]) == 2


def test_planted_tp_plan_bug_is_localised(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["fsdp2-tp2-bug"]
    assert outcome.status == "failed"
    loc = outcome.localisation
    assert loc is not None and "error" not in loc, loc
    assert loc["module"] == BUGGY_MODULE
    rows = {r["name"]: r for r in loc["modules"]}
    # Everything before the buggy module agrees (same weights, same batch).
    before = [r for r in loc["modules"][: [r["name"] for r in loc["modules"]].index(BUGGY_MODULE)]]
    assert before and not any(r["differs"] for r in before)
    assert rows[BUGGY_MODULE]["differs"] and rows["output"]["differs"]
    control_file, test_file = (Path(p) for p in loc["probe_files"].split(" vs "))
    again = compare_probe_files(control_file, test_file)
    assert again["module"] == BUGGY_MODULE


def test_failure_text_and_reports_name_the_module(outcomes: dict[str, Any], tmp_path: Path) -> None:
    from convergence.report.formats.write import write_reports
    from pytest_convergence.failure_section import render_outcome

    text = render_outcome(outcomes["fsdp2-tp2-bug"])
    assert f"module: {BUGGY_MODULE}" in text
    assert "'abs_diff'" not in text  # the tables stay out of the failure message
    write_reports(list(outcomes.values()), tmp_path, environment={"python": "3"})
    md = (tmp_path / "report.md").read_text()
    assert "## Numerics probe" in md and f"first differing module `{BUGGY_MODULE}`" in md
    assert "| layers.1.attention.wo |" in md and "all 51 module outputs" in md
    html = (tmp_path / "report.html").read_text()
    assert "Numerics probe" in html and '<tr class="bad"><td>layers.1.attention.wo' in html


# -- probing at the first divergent step (a bug invisible at step 1) ---------------------------

LATE_PARAMETER = "layers.0.feed_forward.w2.weight"  # planted_late_bugs.BUGGY_PARAMETER
LATE_STEP = 3  # planted_late_bugs.FIRST_BAD_STEP


def test_first_divergent_step_and_failure_line() -> None:
    from convergence.checks.base import first_divergent_step
    from convergence.report.sections.probe import failure_line, summary_text
    from convergence.run.probe import agrees
    from convergence.stats.types import MetricVerdict

    def verdict(metric: str, passed: bool, first: int | None, gate: bool = True) -> Any:
        return MetricVerdict(
            metric=metric,
            method="paired",
            passed=passed,
            gate=gate,
            steps_compared=9,
            first_divergent_step=first,
        )

    assert (
        first_divergent_step(
            [
                verdict("loss", False, 4),
                verdict("grad_norm", False, 3),
                verdict("tokens_per_s", False, 1, gate=False),
                verdict("lr", True, None),
            ]
        )
        == 3
    )
    assert first_divergent_step([verdict("loss", True, None)]) is None
    late = {
        "module": None,
        "parameter": LATE_PARAMETER,
        "step": 3,
        "first_divergent_step": 3,
        "step_1_agrees": True,
        "modules_compared": 51,
        "replay_loss_max_abs_diff": 0.0,
    }
    assert not agrees(late) and agrees({"module": None, "parameter": None})
    assert not agrees({"error": "boom"})
    assert failure_line(late) == (
        "first divergence at step 3; probe at step 3: module outputs "
        f"agree, first differing gradient {LATE_PARAMETER}"
    )
    text = summary_text(late)
    assert text.startswith("step 3 (first divergent step; step 1 agreed): ") and "NOT" not in text
    off = summary_text(dict(late, replay_loss_max_abs_diff=1e-3))
    assert "did NOT reproduce the run" in off
    # The step-1 probe found the module although the curves part at step 5 only.
    early = {"module": BUGGY_MODULE, "parameter": None, "step": 1, "first_divergent_step": 5}
    assert failure_line(early).startswith(
        f"first divergence at step 5; probe at step 1: first differing module {BUGGY_MODULE}"
    )
    assert summary_text(early).startswith("step 1 (curves part at step 5): ")
    # Per-DP-rank losses are shown where a side has DP > 1 (a data-sharding bug shows there).
    ranks = dict(early, dp_losses_control=[5.5, 5.25], dp_losses_test=[5.5, 5.5])
    assert summary_text(ranks).endswith("per-DP-rank loss [5.5, 5.25] vs [5.5, 5.5]")
    assert "per-DP-rank" not in summary_text(
        dict(early, dp_losses_control=[5.5], dp_losses_test=[5.5])
    )


@pytest.fixture(scope="module")
def late_outcome(outcomes: dict[str, Any]) -> Any:
    # In the shared experiment: the DDP control's run, seed checkpoint and step-1 probe are
    # reused, so this pair costs its test run and three probe jobs.
    return outcomes["fsdp2-late-bug"]


def test_late_bug_invisible_at_step1_is_localised_at_the_divergent_step(late_outcome: Any) -> None:
    outcome = late_outcome
    assert outcome.status == "failed", outcome.error
    assert outcome.verdict("grad_norm").first_divergent_step == LATE_STEP
    loc = outcome.localisation
    assert loc is not None and "error" not in loc, loc
    # Step 1 agreed everywhere, so the probe ran again at the first divergent step ...
    assert loc["step_1_agrees"] and loc["step"] == LATE_STEP
    assert loc["first_divergent_step"] == LATE_STEP
    # ... on exactly the state both runs had there (the replayed steps 1-2 are bitwise the run's).
    assert loc["replay_loss_max_abs_diff"] == 0.0
    # The forward of step 3 still agrees (same weights); the doubled gradient alone differs.
    assert loc["module"] is None and loc["modules_differing"] == 0
    assert loc["parameter"] == LATE_PARAMETER
    assert [r["name"] for r in loc["parameters"] if r["differs"]] == [LATE_PARAMETER]
    row = next(r for r in loc["parameters"] if r["name"] == LATE_PARAMETER)
    assert row["test"] == pytest.approx(2 * row["control"], rel=1e-5)


def test_late_localisation_in_failure_text_and_reports(late_outcome: Any, tmp_path: Path) -> None:
    from convergence.report.formats.write import write_reports
    from pytest_convergence.failure_section import render_outcome

    text = render_outcome(late_outcome)
    assert (
        f"first divergence at step {LATE_STEP}; probe at step {LATE_STEP}: module outputs "
        f"agree, first differing gradient {LATE_PARAMETER}"
    ) in text
    write_reports([late_outcome], tmp_path, environment={"python": "3"})
    md = (tmp_path / "report.md").read_text()
    assert f"step {LATE_STEP} (first divergent step; step 1 agreed)" in md
    assert f"| {LATE_PARAMETER} |" in md
    report = json.loads((tmp_path / "report.json").read_text())
    (record,) = report["pairs"]
    assert record["localisation"]["step"] == LATE_STEP
    assert record["localisation"]["parameter"] == LATE_PARAMETER
    html = (tmp_path / "report.html").read_text()
    assert f"step {LATE_STEP} (first divergent step; step 1 agreed)" in html

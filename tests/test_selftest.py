"""``convergence selftest`` (convergence/selftest/): the shipped bugs planted on a user's
layouts, run against the experiment's own control -- through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from convergence.selftest.run import BUGS, render_table, selftest
from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout
from experiments import builtin_pair

ROOT = Path(__file__).resolve().parents[1]


def test_which_bugs_apply_to_which_layout() -> None:
    applies = {
        name: [b.name for b in BUGS if b.applies(layout)]
        for name, layout in {
            "single": ParallelLayout(),
            "fsdp2-cp2": ParallelLayout(dp_shard=2, cp=2),
            "tp2-pp2": ParallelLayout(tp=2, pp=2),
        }.items()
    }
    assert applies == {
        "single": ["gradient-2x"],
        "fsdp2-cp2": ["gradient-2x", "dp-rank-dropped", "cp-rope-offset"],
        "tp2-pp2": ["gradient-2x", "pp-loss-summed"],
    }


def test_an_unknown_bug_is_refused_with_the_names_to_use() -> None:
    with pytest.raises(SpecError, match="(?s)unknown selftest bug.*use some of gradient-2x"):
        selftest([], run=lambda p: None, devices=8, bugs=["gradient-3x"])  # type: ignore[arg-type,return-value]


def test_selftest_on_a_users_experiment_prints_the_power_table(tmp_path: Path) -> None:
    """An experiment outside the repository (its own folder and workdir): the correct FSDP2+TP2
    layout passes and both bugs that apply are caught; a layout with its own hook is left
    out; the JSON holds the same rows."""
    folder = tmp_path / "user"
    path = builtin_pair(
        folder,
        file="mine.toml",
        steps=4,
        seed=11,
        train_config="debug",
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            {"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}},
            {
                "name": "own-hook",
                "parallelism": {"dp_shard": 2},
                "hook": "convergence.selftest.bugs:gradient_doubled",
            },
        ],
    )
    out = tmp_path / "power.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "convergence.cli",
            "selftest",
            str(path),
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
            "--bugs",
            "gradient-2x,dp-rank-dropped",
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    table = {(r["layout"], r["bug"]): r for r in rows}
    assert table[("fsdp2-tp2", "(correct)")]["status"] == "passes"
    assert 0 <= table[("fsdp2-tp2", "(correct)")]["worst_share"] <= 1
    for bug in ("gradient-2x", "dp-rank-dropped"):
        caught = table[("fsdp2-tp2", bug)]
        assert caught["status"] == "caught" and caught["step"] >= 1, caught
        assert caught["metric"].startswith("grad_norm"), caught  # Adam hides a scale in the loss
    assert table[("fsdp2", "-")]["status"] == "left out"  # its own hook
    assert "2 caught, 0 missed, 0 false alarm(s)" in done.stdout
    assert render_table(rows).splitlines()[0].split()[:3] == ["layout", "bug", "result"]

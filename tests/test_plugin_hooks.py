"""Our hooks for other plugins (pytest_convergence/hookspecs.py), through a real pytest
session (pytester) with a conftest.py that implements them: one pair vetoed, one changed
before it runs, and every verdict posted to a "dashboard" file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments import write_experiment

CONFTEST = """
import dataclasses, json
from pathlib import Path

import pytest


def pytest_convergence_modify_pair(config, pair):
    if pair.name == "vetoed":
        pytest.skip("vetoed by the lab's plugin")
    shorter = {side: dataclasses.replace(getattr(pair, side), steps=4) for side in ("control", "test")}
    return dataclasses.replace(pair, **shorter)


def pytest_convergence_pair_verdict(config, outcome):
    with open(Path(str(config.rootpath)) / "dashboard.jsonl", "a") as f:
        line = {"pair": outcome.pair.name, "status": outcome.status,
                "test_steps": outcome.pair.test.steps,
                "loss": [v.passed for v in outcome.verdicts if v.metric == "loss"]}
        f.write(json.dumps(line) + "\\n")
"""

REPLAY = """\
import json, sys
from pathlib import Path
out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
steps = int(sys.argv[1])
with open(out / "metrics.jsonl", "w") as f:
    for s in range(1, steps + 1):
        f.write(json.dumps({"step": s, "loss": 3.0 * 0.95 ** s, "grad_norm": 1.0 / s}) + "\\n")
"""


def test_other_plugins_change_veto_and_hear_each_pair(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(CONFTEST)
    root = Path(pytester.path)
    (root / "replay.py").write_text(REPLAY)
    (root / "cfg.toml").write_text("# hashed only\n")
    job = {
        "backend": "command",
        "backend_options": {"command": ["replay.py", "{steps}", "{dump_dir}"], "launch": "direct"},
    }
    (root / "experiments").mkdir()
    write_experiment(
        root / "experiments",
        defaults={"train_config": str(root / "cfg.toml"), "steps": 6, **job},
        control={"name": "control"},
        tests=[{"name": "changed"}, {"name": "vetoed"}],
    )
    result = pytester.runpytest_subprocess("-m", "convergence", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*vetoed by the lab's plugin*"])
    lines = [json.loads(x) for x in (root / "dashboard.jsonl").read_text().splitlines()]
    # The verdict hook saw the pair as the modify hook changed it (both sides: 4 steps).
    assert lines == [{"pair": "changed", "status": "passed", "test_steps": 4, "loss": [True]}]


CHANGES_INTO_INVALID = """
import dataclasses


def pytest_convergence_modify_pair(config, pair):
    # The command backend saves no anchors: preflight refuses anchor_every for it.
    return dataclasses.replace(pair, check_keys=(("anchor_every", 2),))
"""


def test_a_pair_a_hook_changed_is_checked_like_any_other(pytester: pytest.Pytester) -> None:
    """modify_pair runs before collection's checks: a change that makes the pair invalid is a
    collection error naming the key and the fix, and nothing runs."""
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(CHANGES_INTO_INVALID)
    root = Path(pytester.path)
    (root / "cfg.toml").write_text("# hashed only\n")
    (root / "experiments").mkdir()
    job = {"backend": "command", "backend_options": {"command": ["true"], "launch": "direct"}}
    write_experiment(
        root / "experiments",
        defaults={"train_config": str(root / "cfg.toml"), "steps": 6, **job},
        control={"name": "control"},
        tests=[{"name": "changed"}],
    )
    result = pytester.runpytest_subprocess("-m", "convergence", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*nothing was launched*", "*anchor_every needs a trainer*"])
    assert not (root / ".convergence" / "runs").exists()

"""``convergence selftest`` on a torchtitan experiment: the logits' bug planted through
torchtitan's own model parts (its output projection is ``lm_head``), caught by the verdict;
torchtitan's own step lines are shown in CI's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

from torchtitan_session import show_step_lines

ROOT = Path(__file__).resolve().parents[1]


def test_selftest_plants_a_bug_through_torchtitan(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    out, work = tmp_path / "power.json", tmp_path / "work"
    done = subprocess.run(
        [
            sys.executable, "-m", "convergence.cli", "selftest",
            str(ROOT / "experiments" / "torchtitan" / "cpu.toml"), "--rootdir", str(ROOT),
            "--layouts", "fsdp2-tp2-sp", "--bugs", "gradient-2x", "--steps", "4",
            "--json", str(out), "--workdir", str(work),
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {(r["layout"], r["bug"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("fsdp2-tp2", "(correct)")]["status"] == "passes", rows
    caught = rows[("fsdp2-tp2", "gradient-2x")]
    assert caught["status"] == "caught" and caught["metric"].startswith("grad_norm"), caught
    assert show_step_lines(request, work / "runs"), "torchtitan logged no step line"

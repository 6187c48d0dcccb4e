"""The tutorial (docs/tutorial.md) as a newcomer follows it: its files are written from its
code blocks into a fresh project, and its command runs there. The planted bug must fail its
pair, and the numerics probe must name the module the bug is in; the correct TP plan must
pass (issue 52: "from README and the site alone, a newcomer reaches a failing planted bug and
its probe")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import fenced_blocks, write_project

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "docs" / "tutorial.md"
#: Where the tutorial plants its bug (my_project/buggy.py: layer 1's row-wise w2).
BUGGY_MODULE = "layers.1.feed_forward.w2"


def _command() -> list[str]:
    """The tutorial's run command, as it writes it (``PYTHONPATH=. pytest ...``)."""
    lines = [
        line
        for lang, body in fenced_blocks(TUTORIAL.read_text(encoding="utf-8"))
        if lang == "bash"
        for line in body.splitlines()
        if "pytest -m convergence" in line
    ]
    (line,) = set(lines)
    env, _, rest = line.partition(" ")
    assert env == "PYTHONPATH=." and rest.startswith("pytest "), line
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *rest.split()[1:]]


def _run(project: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(REPO)])  # "." and this checkout
    env["COLUMNS"] = "160"
    return subprocess.run(
        [*_command(), *extra], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )


def test_the_tutorials_files_are_complete(tmp_path: Path) -> None:
    written = {p.relative_to(tmp_path).as_posix() for p in write_project(TUTORIAL, tmp_path)}
    assert written == {"my_project/parallel.py", "my_project/buggy.py", "experiments/my_tp.toml"}
    assert (tmp_path / "my_project" / "__init__.py").is_file()
    experiment = (tmp_path / "experiments" / "my_tp.toml").read_text()
    assert 'name = "fsdp2-my-tp2"' in experiment and 'name = "fsdp2-my-tp2-buggy"' in experiment
    for path in (tmp_path / "my_project").glob("*.py"):
        compile(path.read_text(), str(path), "exec")


def test_the_planted_bug_fails_and_the_probe_names_its_module(tmp_path: Path) -> None:
    """The CI-sized run: the buggy pair alone, 6 steps (the tutorial's own 20 run in the
    slow test below)."""
    write_project(TUTORIAL, tmp_path)
    proc = _run(tmp_path, "experiments/my_tp.toml::fsdp2-my-tp2-buggy", "--convergence-steps", "6")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (pair,) = report["pairs"]
    assert pair["status"] == "failed", pair["verdicts"]
    assert pair["localisation"]["module"] == BUGGY_MODULE, pair["localisation"]
    assert f"first differing module {BUGGY_MODULE}" in out, out[-5000:]


@pytest.mark.slow
def test_the_whole_tutorial(tmp_path: Path) -> None:
    """Both pairs at the tutorial's steps: the correct plan passes, the bug fails."""
    write_project(TUTORIAL, tmp_path)
    proc = _run(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    status = {p["name"]: p["status"] for p in report["pairs"]}
    assert status == {"fsdp2-my-tp2": "passed", "fsdp2-my-tp2-buggy": "failed"}, status

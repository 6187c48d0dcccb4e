"""The way users get the plugin: a real wheel, installed (not editable) into a fresh virtualenv,
used from a repository of their own outside this source tree.

To keep it affordable the fresh venv reuses this environment's installed dependencies (torch,
numpy, ...) through a ``.pth`` line, and the wheel is installed with ``--no-deps``: what is
under test is our wheel's content and behaviour, not pip's resolver.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from experiments import experiment_doc, write_toml

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("install_wheel")

REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = experiment_doc(
    defaults={"train_config": "debug", "steps": 3, "seed": 5},  # debug: shipped in the wheel
    control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
    tests=[{"name": "ddp2", "parallelism": {"dp_replicate": 2}}],
)

# A torchtitan-style job config that merely lives under experiments/: never ours.
FOREIGN = {
    "job": {"dump_folder": "./outputs", "description": "Llama debug training"},
    "model": {"name": "llama3", "flavor": "debugmodel"},
}


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A venv holding only our wheel (plus this environment's dependencies, read-only)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
        cwd=tmp,
        env=env,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(dist.glob("pytest_convergence-*.whl"))
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp, env=env)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        cwd=tmp,
        env=env,
    ).stdout.strip()
    ours = sysconfig.get_path("purelib")
    (Path(purelib) / "_host_deps.pth").write_text("\n".join([ours, *site.getsitepackages()]) + "\n")
    installed = _run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=tmp, env=env
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    repo = tmp / "user_repo"
    (repo / "experiments" / "llama").mkdir(parents=True)
    write_toml(repo / "experiments" / "mine.toml", EXPERIMENT)
    write_toml(repo / "experiments" / "llama" / "debug_model.toml", FOREIGN)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    (repo / "report").mkdir()  # exists already, as on any second run
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return repo, env


def test_wheel_carries_configs_and_version(user_env: tuple[Path, dict[str, str]]) -> None:
    repo, env = user_env
    version = _run(["convergence", "--version"], cwd=repo, env=env)
    assert version.returncode == 0 and version.stdout.startswith("convergence "), version
    configs = _run(["convergence", "configs"], cwd=repo, env=env)
    assert configs.returncode == 0, configs.stderr
    assert "debug" in configs.stdout and "gpt2_small" in configs.stdout
    assert str(REPO) not in configs.stdout  # read from the installed wheel, not this tree


def test_foreign_toml_never_disturbs_other_tests(user_env: tuple[Path, dict[str, str]]) -> None:
    repo, env = user_env
    proc = _run(
        ["python", "-m", "pytest", "-m", "not convergence", "-p", "no:cacheprovider", "-q"],
        cwd=repo,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout and "error" not in proc.stdout.lower(), proc.stdout


@pytest.mark.parametrize("form", ["space", "equals"])
def test_experiment_with_shipped_config_and_both_report_forms(
    user_env: tuple[Path, dict[str, str]], form: str
) -> None:
    repo, env = user_env
    report = repo / "report"
    option = (
        ["--convergence-report", "report"] if form == "space" else ["--convergence-report=report"]
    )
    proc = _run(
        ["python", "-m", "pytest", "-m", "convergence", *option, "-p", "no:cacheprovider"],
        cwd=repo,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "mine.toml::ddp2 PASSED" in out or "1 passed" in out, out[-3000:]
    # No ini file in this repository: run state lives in the invocation dir, as the header says.
    assert f"convergence: run state in {repo / '.convergence'}" in out, out[:2000]
    assert (repo / ".convergence" / "runs").is_dir()
    data = json.loads((report / "report.json").read_text())
    assert [p["name"] for p in data["pairs"]] == ["ddp2"]
    assert data["pairs"][0]["status"] == "passed"


def test_testpaths_repo_runs_its_convergence_paths(user_env: tuple[Path, dict[str, str]]) -> None:
    """Issue 24, trap 1, as a user meets it: a repository whose pytest config has
    ``testpaths = ["tests"]`` (most do) and ``convergence_paths = ["experiments"]``;
    ``pytest -m convergence`` runs its experiments (one real 3-step pair)."""
    base, env = user_env
    repo = base.parent / "testpaths_repo"
    (repo / "experiments").mkdir(parents=True)
    (repo / "tests").mkdir()
    write_toml(repo / "experiments" / "mine.toml", EXPERIMENT)
    (repo / "tests" / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    # pytest's own config file, written as a user writes it (not an experiment).
    (repo / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\nconvergence_paths = ["experiments"]\n'
    )
    proc = _run(
        ["python", "-m", "pytest", "-m", "convergence", "-p", "no:cacheprovider", "-rA"],
        cwd=repo,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "PASSED experiments/mine.toml::ddp2" in out and "1 passed, 1 deselected" in out, out[
        -3000:
    ]
    plain = _run(["python", "-m", "pytest", "-p", "no:cacheprovider", "-q"], cwd=repo, env=env)
    assert "1 passed" in plain.stdout and "mine.toml" not in plain.stdout, plain.stdout

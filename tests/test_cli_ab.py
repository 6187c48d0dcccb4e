"""`convergence ab`: a trainer's two commits, made in a real git repository in the test, run
through real torchrun and judged with the paired verdict."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import convergence.cli.ab as ab
from convergence.cli import main
from convergence.options import run_settings
from convergence.worktrees import git as _git  # a failing git names itself
from experiments import experiment_doc, write_toml

TRAINER = '''\
"""A deterministic stand-in trainer: rank 0 logs loss and grad norm per step."""
import argparse, json, os
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int)
parser.add_argument("--out", type=Path)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
if os.environ.get("RANK", "0") == "0":
    with open(args.out / "metrics.jsonl", "w") as f:
        for step in range(1, args.steps + 1):
            loss = 3.0 * 0.95 ** step + 1.0{bug}
            f.write(json.dumps({{"step": step, "loss": loss, "grad_norm": 1.0 / step}}) + "\\n")
'''

EXPERIMENT = experiment_doc(
    defaults={
        "train_config": "cfg.toml",
        "steps": 6,
        "backend": "command",
        "backend_options": {"command": "train.py --steps {steps} --out {dump_dir}"},
    },
    control={"name": "ddp2", "parallelism": {"dp_replicate": 2}},
    tests=[{"name": "fsdp2", "parallelism": {"dp_shard": 2}}],
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """main: a correct trainer; branch "bug": the loss drifts from step 4 on."""
    repo = tmp_path / "trainer"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "train.py").write_text(TRAINER.format(bug=""))
    (repo / "cfg.toml").write_text("# hashed only\n")
    write_toml(repo / "exp.toml", EXPERIMENT)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "trainer")
    _git(repo, "checkout", "-q", "-b", "bug")
    (repo / "train.py").write_text(TRAINER.format(bug=" + (0.01 if step >= 4 else 0.0)"))
    _git(repo, "commit", "-q", "-am", "a change that moves the loss")
    _git(repo, "checkout", "-q", "main")
    return repo


def test_a_change_that_moves_the_loss_fails_and_names_the_step(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo)
    code = main(
        [
            "ab",
            "exp.toml",
            "--baseline",
            "main",
            "--candidate",
            "bug",
            "--workdir",
            str(tmp_path / "work"),
            "--report",
            str(tmp_path / "report"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "loss diverges from step 4" in out, out
    assert "baseline main vs candidate bug" in out
    assert (tmp_path / "report" / "report.json").is_file()
    assert _git(repo, "worktree", "list").count("\n") == 0, "worktrees left behind"


def test_the_same_commit_on_both_sides_passes(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo)
    head = _git(repo, "rev-parse", "HEAD")
    code = main(
        [
            "ab",
            "exp.toml",
            "--baseline",
            "main",
            "--candidate",
            head[:10],
            "--workdir",
            str(tmp_path / "work"),
            "--steps",
            "3",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.count("PASS") >= 2  # both jobs (ddp2, fsdp2)


def test_an_unknown_ref_is_a_clear_error(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo)
    code = main(
        [
            "ab",
            "exp.toml",
            "--baseline",
            "main",
            "--candidate",
            "no-such-branch",
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "no-such-branch" in err and "fix:" in err


def test_settings_come_from_the_shared_option_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ab` builds its RunSettings through convergence.options (relative paths against the
    invocation directory, the table's checks), with early stop always off."""
    seen = {}

    def fake_run_ab(*args: object, settings: object, **kwargs: object) -> list[object]:
        seen["settings"] = settings
        return []

    monkeypatch.setattr(ab, "run_ab", fake_run_ab)
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "ab",
                "exp.toml",
                "--baseline",
                "a",
                "--candidate",
                "b",
                "--steps",
                "3",
                "--devices=2",
                "--workdir",
                "wd",
                "--wall-limit",
                "50",
            ]
        )
        == 0
    )
    settings = seen["settings"]
    assert settings.work_dir == (tmp_path / "wd").resolve()
    assert (settings.steps, settings.devices, settings.wall_limit_s) == (3, 2, 50.0)
    assert settings.early_stop is False and settings.cache_dir is None
    expected = run_settings(
        {"steps": 3, "devices": 2, "wall-limit": 50.0, "no-early-stop": True},
        work_dir=settings.work_dir,
    )
    assert settings == dataclasses.replace(expected, session_id=settings.session_id)
    assert main(["ab", "exp.toml", "--baseline", "a", "--candidate", "b", "--steps", "0"]) == 2
    assert "convergence ab: --steps must be >= 1, got 0" in capsys.readouterr().err

"""`convergence bisect`: a real git history made in the test (8 commits, one planted bad one),
each step a real pair run (command backend, ``launch = "direct"``: the stand-in trainer is one
process, so a step costs a fraction of a second, not torchrun's start-up; `convergence ab`'s
tests run the same worktree machinery through torchrun), the control reused from the run cache
while the trainer's sources do not change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convergence.cli import main
from convergence.worktrees import git as _git  # a failing git names itself
from experiments import dumps, experiment_doc

TRAINER = '''\
"""A deterministic stand-in trainer: rank 0 logs loss and grad norm per step."""
import argparse, json, os
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int)
parser.add_argument("--dp-shard", type=int)
parser.add_argument("--out", type=Path)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
if os.environ.get("RANK", "0") == "0":
    with open(args.out / "metrics.jsonl", "w") as f:
        for step in range(1, args.steps + 1):
            loss = 3.0 * 0.95 ** step + 1.0{bug}
            f.write(json.dumps({{"step": step, "loss": loss, "grad_norm": 1.0 / step}}) + "\\n")
'''
#: The planted bug: sharded runs drift from step 3 on (what a broken FSDP change looks like);
#: the control (replicated) is untouched, so only the pair's verdict can tell.
BUG = " + (0.02 * step if step >= 3 and args.dp_shard > 1 else 0.0)"


def experiment(trainer: str = "train.py", *args: str) -> str:
    """The committed exp.toml: DDP2 against FSDP2, ``trainer`` (keyed by its source) run
    directly with ``args`` before the usual options."""
    command = " ".join([trainer, *args, "--steps {steps} --dp-shard {dp_shard} --out {dump_dir}"])
    return dumps(
        experiment_doc(
            defaults={
                "train_config": "cfg.toml",
                "steps": 8,
                "backend": "command",
                "backend_options": {"launch": "direct", "command": command, "sources": [trainer]},
            },
            control={"name": "ddp2", "parallelism": {"dp_replicate": 2}},
            tests=[{"name": "fsdp2", "parallelism": {"dp_shard": 2}}],
        )
    )


EXPERIMENT = experiment()


def _commit(repo: Path, message: str, **files: str) -> str:
    for name, text in files.items():
        path = repo / name.replace("__", ".")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "trainer"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    return repo


@pytest.fixture
def history(tmp_path: Path) -> tuple[Path, list[str]]:
    """8 commits on main; the 5th plants the bug, the others touch notes only."""
    repo = _repo(tmp_path)
    commits = [
        _commit(
            repo,
            "c1 trainer",
            train__py=TRAINER.format(bug=""),
            cfg__toml="# hashed only\n",
            exp__toml=EXPERIMENT,
            notes__txt="1\n",
        )
    ]
    for i in range(2, 9):
        if i == 5:
            commits.append(
                _commit(repo, f"c{i} faster sharding", train__py=TRAINER.format(bug=BUG))
            )
        else:
            commits.append(_commit(repo, f"c{i} notes", notes__txt=f"{i}\n"))
    return repo, commits


def test_finds_the_planted_commit_in_four_pair_runs(
    history: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo, commits = history
    monkeypatch.chdir(repo)
    (repo / "notes.txt").write_text("uncommitted\n")  # a dirty worktree: said, not bisected
    out_json = tmp_path / "bisect.json"
    code = main(
        [
            "bisect",
            commits[0][:10],
            "main",
            "exp.toml::fsdp2",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out_json),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1, out + err
    result = json.loads(out_json.read_text())
    assert result["first_bad"] == commits[4], out
    assert result["pair_runs"] <= 4, out
    assert [s["commit"] for s in result["steps"]][0] == commits[7]  # BAD first
    assert {s["status"] for s in result["steps"]} == {"passed", "failed"}
    # One control per version of train.py: the later steps take it from the run cache.
    assert sum(1 for s in result["steps"] if s["control_cached"] is False) == 2, out
    assert f"first bad commit: {commits[4]}" in out and "c5 faster sharding" in out
    assert "first divergent step 3" in out, out
    assert "uncommitted changes" in err
    assert _git(repo, "worktree", "list").count("\n") == 0, "worktrees left behind"


def test_a_commit_where_the_pair_cannot_run_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """c2's experiment does not load (a collection error): skipped, and the answer names both
    commits the first failing one may be; GOOD is run since no later commit passed."""
    repo = _repo(tmp_path)
    good = _commit(
        repo, "good", train__py=TRAINER.format(bug=""), cfg__toml="#\n", exp__toml=EXPERIMENT
    )
    # Broken on purpose (an unclosed header appended): text, not the TOML writer.
    broken = _commit(repo, "broken experiment", exp__toml=EXPERIMENT + "[[test\n")
    bad = _commit(repo, "bug", train__py=TRAINER.format(bug=BUG), exp__toml=EXPERIMENT)
    _commit(repo, "notes", notes__txt="x\n")
    monkeypatch.chdir(repo)
    out_json = tmp_path / "bisect.json"
    code = main(
        [
            "bisect",
            good,
            "HEAD",
            "fsdp2",
            "--experiment",
            "exp.toml",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out_json),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1, out + err
    result = json.loads(out_json.read_text())
    assert result["candidates"] == [broken, bad], out
    statuses = {s["commit"]: s["status"] for s in result["steps"]}
    assert statuses == {
        commits: status
        for commits, status in (
            (_git(repo, "rev-parse", "HEAD"), "failed"),
            (broken, "skipped"),
            (bad, "failed"),
            (good, "passed"),
        )
    }, out
    assert "skipped (like git bisect skip): the experiment does not load" in out
    assert _git(repo, "worktree", "list").count("\n") == 0


def test_good_not_an_ancestor_of_bad_is_a_clear_error(
    history: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo, commits = history
    monkeypatch.chdir(repo)
    _git(repo, "checkout", "-q", "-b", "side", commits[2])
    side = _commit(repo, "side work", notes__txt="side\n")
    code = main(["bisect", side, "main", "exp.toml::fsdp2", "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2
    assert "is not an ancestor of BAD" in err and "fix:" in err
    assert not (tmp_path / "work" / "bisect").exists()  # nothing ran


def test_bad_passing_and_good_failing_are_said(
    history: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo, commits = history
    monkeypatch.chdir(repo)
    work = ["--workdir", str(tmp_path / "work")]
    # BAD passes (the bug comes later): nothing to bisect, one run.
    assert main(["bisect", commits[0], commits[3], "exp.toml::fsdp2", *work]) == 0
    out = capsys.readouterr().out
    assert "the pair passes at BAD: nothing to bisect" in out and "1 pair run(s)" in out
    # GOOD already has the bug: no commit after it passes, so GOOD is run, and fails.
    assert main(["bisect", commits[4], commits[7], "exp.toml::fsdp2", *work]) == 2
    out, err = capsys.readouterr()
    assert "the pair fails at GOOD too" in err and "pick an older GOOD" in err, out + err


def test_the_search_runs_without_the_front_end(
    history: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """convergence.bisection is the search, the CLI only its arguments and printing: bisect()
    hears of each step as it ends, in order, and says how the search ended (the CLI turns that
    into its exit status)."""
    from convergence.bisection import Bisection, bisect, commits_between
    from convergence.run.jobs import RunSettings

    repo, commits = history
    settings = RunSettings(work_dir=tmp_path / "work")
    assert commits_between(repo, commits[0], "main") == commits
    heard: list[tuple[int, str, str]] = []

    def search(span: list[str]) -> Bisection:
        heard.clear()
        return bisect(
            repo,
            span,
            experiments=["exp.toml"],
            wanted="exp.toml::fsdp2",
            settings=settings,
            on_step=lambda number, step: heard.append((number, step.commit, step.status)),
        )

    found = search(commits)
    assert (found.ending, found.first_bad) == ("found", commits[4])
    assert heard == [(i + 1, s.commit, s.status) for i, s in enumerate(found.steps)]
    assert heard[0][1:] == (commits[7], "failed")  # BAD first
    late = search(commits[4:])  # GOOD has the bug already
    assert (late.ending, late.first_bad) == ("fails_at_good", None)
    assert heard[-1][1:] == (commits[4], "failed") and "fails at GOOD" in late.problem
    assert search(commits[:4]).ending == "passes_at_bad" and len(heard) == 1


SLOW_TRAINER = """\
import os, sys, time
from pathlib import Path
Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(120)
"""


def test_sigterm_leaves_no_worktree_and_no_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bisect killed with SIGTERM (a CI job cancelled) stops its job and removes its
    worktree: the user's repository is as it was. The signal is sent to this very process
    once the job runs (bisect's handler is installed by then; a subprocess would spend most
    of the test importing)."""
    import os
    import signal
    import threading
    import time

    repo = _repo(tmp_path)
    pid_file = tmp_path / "job.pid"
    slow = experiment("slow.py", str(pid_file))
    _commit(repo, "a", slow__py=SLOW_TRAINER, cfg__toml="#\n", exp__toml=slow)
    _commit(repo, "b", notes__txt="b\n")
    monkeypatch.chdir(repo)
    before = signal.getsignal(signal.SIGTERM)

    def kill_when_the_job_runs() -> None:
        deadline = time.monotonic() + 120
        while not pid_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_when_the_job_runs, daemon=True)
    killer.start()
    code = main(
        ["bisect", "HEAD~1", "HEAD", "exp.toml::fsdp2", "--workdir", str(tmp_path / "work")]
    )
    killer.join(timeout=5)
    out, err = capsys.readouterr()
    assert code == 130, out + err
    assert "interrupted" in err
    assert signal.getsignal(signal.SIGTERM) == before  # bisect's handler is gone again
    assert _git(repo, "worktree", "list").count("\n") == 0, "worktree left behind"
    assert not (tmp_path / "work" / "bisect" / "tree").exists()
    job = int(pid_file.read_text())
    for _ in range(50):  # the job was ended; give the kernel a moment to reap it
        try:
            os.kill(job, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"job {job} still running after bisect was killed")


def test_a_pair_that_turned_red_gets_its_bisect_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convergence record --commit` keeps each night's commit; when a pair turns red,
    `convergence decide` prints the bisect command from the last green night's commit to
    tonight's, runnable as it stands (pair id and experiment file from the report)."""
    import report_examples as ex

    from convergence.report.data.schema import build_report

    history = tmp_path / "history.jsonl"
    green, red = "a" * 40, "b" * 40
    for night, (commit, status) in enumerate(((green, "passed"), (red, "failed"))):
        doc = build_report([ex.failing_pair()], environment={}, started_at=None, wall_s=1.0)
        doc["pairs"][0]["status"] = status
        report = tmp_path / f"n{night}" / "report.json"
        report.parent.mkdir()
        report.write_text(json.dumps(doc))
        assert (
            main(
                ["record", str(report), str(history), "--night", f"n{night}"] + ["--commit", commit]
            )
            == 0
        )
    pair_id = doc["pairs"][0]["id"]
    capsys.readouterr()
    assert main(["decide", str(history), "--out", str(tmp_path / "decision")]) == 11
    out = capsys.readouterr().out
    command = f"convergence bisect {green[:12]} {red[:12]} {pair_id} --experiment {ex.SOURCE}"
    assert f"`{command}`" in out.replace("'", ""), out
    decision = json.loads((tmp_path / "decision" / "decision.json").read_text())
    assert decision["findings"][0]["bisect"].replace("'", "") == command


def test_the_control_is_reused_only_while_its_code_is_unchanged(tmp_path: Path) -> None:
    """control_code: what the cache key gets per commit. A hook's package at the commit (so a
    commit elsewhere keeps the control's key, one in the package changes it); a command
    trainer without `sources` gets the commit itself (the key could not tell otherwise)."""
    import dataclasses

    from convergence.bisection import control_code
    from convergence.preflight import load_checked

    repo = _repo(tmp_path)
    (repo / "hooks").mkdir()
    first = _commit(
        repo,
        "hook",
        exp__toml=EXPERIMENT,
        cfg__toml="#\n",
        train__py="",
        **{"hooks/__init__.py": ""},
    )
    second = _commit(repo, "notes", notes__txt="n\n")
    third = _commit(repo, "hook changed", **{"hooks/__init__.py": "X = 1\n"})
    pair = load_checked(repo / "exp.toml", rootdir=repo).pairs[0]
    hooked = dataclasses.replace(
        pair,
        control=dataclasses.replace(
            pair.control, backend="builtin", hook="hooks.par:apply", backend_options=()
        ),
    )
    keys = [control_code(hooked, repo, c, repo) for c in (first, second, third)]
    assert keys[0] == keys[1] != keys[2], keys
    assert control_code(pair, repo, first, repo) is None  # command trainer naming its sources
    bare = dataclasses.replace(
        pair,
        control=dataclasses.replace(
            pair.control, backend_options=(("command", "train.py --out {dump_dir}"),)
        ),
    )
    assert control_code(bare, repo, first, repo) == ("bisect_code", f"commit={first}")

"""Commits of a trainer's repository as folders jobs run in: what ``convergence ab`` and
``convergence bisect`` share.

- :func:`git`: one git command, its failure a :class:`SpecError` naming the repository (the
  commands that can fail read the user's refs and folders);
- :func:`checkout`: a detached worktree at a commit (or an existing folder as it is), removed
  on the way out -- also on Ctrl-C and, inside :func:`sigterm_as_interrupt`
  (:mod:`convergence.process_lifetime`), on SIGTERM;
- :func:`in_tree_settings`: RunSettings whose jobs run in that folder, first on PYTHONPATH, so
  a relative command (``train.py``), a hook module or torchtitan is imported from the commit.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from convergence.process_lifetime import sigterm_as_interrupt
from convergence.run.jobs import RunSettings
from convergence.spec.errors import RunFailed, SpecError

# sigterm_as_interrupt: the front ends that check out commits wrap their work in it.
__all__ = [
    "checkout",
    "git",
    "git_ok",
    "in_tree_settings",
    "remove_worktree",
    "sigterm_as_interrupt",
]


def git(repo: Path, *args: str, key: str = "--repo") -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SpecError(
            f"git {' '.join(args)} failed in {repo}: {(done.stderr or done.stdout).strip()}",
            key=key,
            fix="point --repo at the trainer's git repository and use refs it has "
            "(a branch, tag or commit), or pass existing folders",
        )
    return done.stdout.strip()


def git_ok(repo: Path, *args: str) -> bool:
    """Whether a git command succeeds (``merge-base --is-ancestor`` answers by its status)."""
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True).returncode == 0


def remove_worktree(top: Path, folder: Path) -> None:
    subprocess.run(
        ["git", "-C", str(top), "worktree", "remove", "--force", str(folder)], capture_output=True
    )
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run(["git", "-C", str(top), "worktree", "prune"], capture_output=True)


@contextmanager
def checkout(repo: Path, ref: str, into: Path) -> Iterator[tuple[Path, str]]:
    """The side's folder and a label: an existing folder as it is, else a detached worktree
    of ``repo`` at ``ref`` (removed afterwards). SpecError for a ref that is no commit,
    RunFailed when git cannot add the worktree."""
    folder = Path(ref)
    if folder.is_dir():
        yield folder.resolve(), str(folder)
        return
    top = Path(git(repo, "rev-parse", "--show-toplevel"))
    commit = git(top, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if into.exists():  # a worktree left by an interrupted run
        remove_worktree(top, into)
    into.parent.mkdir(parents=True, exist_ok=True)
    added = subprocess.run(
        ["git", "-C", str(top), "worktree", "add", "--detach", str(into), commit],
        capture_output=True,
        text=True,
    )
    if added.returncode != 0:  # the refs were valid: the disk, a lock, ... not the input
        raise RunFailed(
            f"cannot check out {ref} ({commit[:10]}) into {into}: "
            f"{(added.stderr or added.stdout).strip()}"
        )
    try:
        yield into, f"{ref} ({commit[:10]})"
    finally:
        remove_worktree(top, into)


def in_tree_settings(settings: RunSettings, folder: Path) -> RunSettings:
    """``settings`` with jobs run in ``folder``, which comes first on their PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return dataclasses.replace(settings, job_cwd=folder, job_env=(("PYTHONPATH", path),))

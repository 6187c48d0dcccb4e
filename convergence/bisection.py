"""The first commit at which a pair fails: a binary search over a repository's first-parent
commits from GOOD to BAD, the pair run at each commit in a git worktree
(:mod:`convergence.worktrees`), from that commit's experiment file, with the verdict pytest
gives it. ``convergence bisect`` (convergence/cli/bisect.py, whose help tells users the rules)
is its front end: arguments in, steps and answer printed.

- :func:`commits_between`: ``[GOOD, ..., BAD]``, checked (GOOD an ancestor of BAD);
- :func:`run_step`: one commit checked out and its pair run -- a :class:`Step` passed, failed,
  error (the test job broke next to a healthy control: red, as the nightly says) or skipped
  (the pair cannot run there, like ``git bisect skip``);
- :func:`control_code`: what the run-cache key adds so that the pair's own control is reused
  between commits exactly while the code it runs is unchanged;
- :func:`bisect`: the search (BAD first, GOOD only when the answer rests on it), a
  :class:`Bisection` with the first failing commit, or the few it may be, or why there is none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from convergence.backends import get_backend
from convergence.checks.base import first_divergent_step
from convergence.preflight import load_checked
from convergence.run.jobs import RunSettings
from convergence.run.outcome import PairOutcome
from convergence.run.session import SessionRunner
from convergence.spec.errors import SpecError
from convergence.spec.pair import PairSpec
from convergence.worktrees import checkout, git, git_ok, in_tree_settings

Ending = Literal["found", "passes_at_bad", "cannot_run_at_bad", "fails_at_good"]
"""How a search ended: the first failing commit found (or the few it may be); the pair passes
at BAD (nothing to bisect); no answer because of what was asked (the pair cannot run at BAD, or
it fails at GOOD too)."""


@dataclass(frozen=True, kw_only=True)
class Step:
    """One commit tried."""

    commit: str
    subject: str
    status: str
    """passed | failed | error (the test job broke) | skipped (the pair could not run)."""
    first_divergent_step: int | None = None
    stopped_early_at: int | None = None
    wall_s: float = 0.0
    control_cached: bool | None = None
    why: str = ""
    """Why it was skipped or errored."""
    outcome: PairOutcome | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def bad(self) -> bool:
        return self.status in ("failed", "error")

    def to_json(self) -> dict[str, Any]:
        """Every field but the outcome (the report's to tell), in their order."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["outcome"]
        return {**fields, "wall_s": round(self.wall_s, 3), "why": self.why or None}


@dataclass(frozen=True, kw_only=True)
class Bisection:
    """What the search found: ``first_bad`` (None when it found nothing) and the steps."""

    good: str
    bad: str
    pair: str
    commits: tuple[str, ...]
    steps: tuple[Step, ...]
    first_bad: str | None = None
    candidates: tuple[str, ...] = ()
    """When skipped commits leave it open: every commit the first failing one may be."""
    problem: str = ""
    """Why there is no answer (BAD passes, GOOD fails, the pair cannot run at BAD)."""
    ending: Ending = "found"

    def to_json(self) -> dict[str, Any]:
        return {
            "good": self.good,
            "bad": self.bad,
            "pair": self.pair,
            "commits": len(self.commits) - 1,
            "pair_runs": len(self.steps),
            "steps": [s.to_json() for s in self.steps],
            "first_bad": self.first_bad,
            "candidates": list(self.candidates),
            "problem": self.problem or None,
        }


def commits_between(repo: Path, good: str, bad: str) -> list[str]:
    """[GOOD, ..., BAD]: GOOD and the first-parent commits after it up to BAD, oldest first."""
    good_sha = git(repo, "rev-parse", "--verify", "--quiet", f"{good}^{{commit}}", key="GOOD")
    bad_sha = git(repo, "rev-parse", "--verify", "--quiet", f"{bad}^{{commit}}", key="BAD")
    if good_sha == bad_sha:
        raise SpecError(
            f"GOOD and BAD are the same commit ({good_sha[:10]})",
            key="GOOD",
            fix="pass a commit where the pair passed as GOOD and a later one where it fails",
        )
    ancestor = git_ok(repo, "merge-base", "--is-ancestor", good_sha, bad_sha)
    if not ancestor:
        raise SpecError(
            f"GOOD {good} ({good_sha[:10]}) is not an ancestor of BAD {bad} ({bad_sha[:10]})",
            key="GOOD",
            fix="pass as GOOD a commit BAD's history contains (`git merge-base GOOD BAD` "
            "is one), e.g. the last green night's commit",
        )
    later = git(repo, "rev-list", "--first-parent", "--reverse", f"{good_sha}..{bad_sha}")
    return [good_sha, *later.split()]


def experiment_paths(top: Path, bad: str, pair: str, given: list[str], cwd: Path) -> list[str]:
    """The experiment files, each as a path inside the repository when it is in it (read at
    every commit from that commit's tree), else as it is (absolute)."""
    if given:
        out = []
        for name in given:
            path = (cwd / name).resolve()
            try:
                out.append(path.relative_to(top.resolve()).as_posix())
            except ValueError:
                out.append(str(path))
        return out
    if "::" not in pair:
        raise SpecError(
            f"pair {pair!r} names no experiment file",
            key="PAIR",
            fix="pass the pair's id as reports print it (exp.toml::name) or --experiment FILE",
        )
    file_name = pair.split("::", 1)[0]
    tracked = git(top, "ls-tree", "-r", "--name-only", bad).splitlines()
    found = [p for p in tracked if p.rsplit("/", 1)[-1] == file_name]
    if len(found) != 1:
        where = "none" if not found else ", ".join(found)
        raise SpecError(
            f"{len(found)} files named {file_name!r} in BAD ({where})",
            key="--experiment",
            fix="name the experiment file with --experiment FILE",
        )
    return found


def find_pair(pairs: list[PairSpec], wanted: str) -> PairSpec | None:
    """By id (``exp.toml::fsdp2``), else by the test's name (``fsdp2``)."""
    for pair in pairs:
        if pair.pair_id == wanted:
            return pair
    name = wanted.split("::", 1)[-1]
    matches = [p for p in pairs if p.pair_id.split("::", 1)[-1] == name or p.test.name == name]
    return matches[0] if len(matches) == 1 else None


def control_code(pair: PairSpec, top: Path, commit: str, tree: Path) -> tuple[str, str] | None:
    """What the run-cache key must add so that a control is reused between commits only
    when the code it runs is the same; None when the key already covers it.

    - command trainer with ``backend_options.sources``: the sources' content is in the key
      (the experiment is read from the commit's worktree, so they are that commit's); without
      them the key knows the command text only: the commit goes in (no reuse, but correct);
    - a hook (built-in trainer, torchtitan): git's tree id of the hook's top-level package
      (or module file) at the commit -- the hook may import anything in its package;
    - the trainer's own code (Backend.code_identity): the packages it names -- the
      installed one's version is in the key; when the repository holds it (bisecting
      pytest-convergence or torchtitan itself), its folder's tree id at the commit; a
      backend whose key does not hold its code: the commit.
    """
    job = pair.control
    identity = get_backend(job.backend).code_identity(job)
    parts: list[str] = []

    def tree_id(rel: str) -> None:
        if (tree / rel).exists():
            parts.append(f"{rel}={git(top, 'rev-parse', f'{commit}:{rel}')}")

    if job.hook:
        top_module = job.hook.split(":", 1)[0].split(".", 1)[0]
        tree_id(top_module if (tree / top_module).is_dir() else f"{top_module}.py")
    for package in identity.packages:
        tree_id(package)
    if not identity.keyed:
        parts.append(f"commit={commit}")
    return ("bisect_code", " ".join(parts)) if parts else None


def subject(top: Path, commit: str) -> str:
    """The commit's subject line."""
    return git(top, "log", "-1", "--format=%s", commit)


def run_step(
    top: Path,
    commit: str,
    *,
    experiments: list[str],
    wanted: str,
    settings: RunSettings,
) -> Step:
    """Check ``commit`` out, load its experiment, run the pair there (skipped when it
    cannot run)."""

    started = time.monotonic()
    title = subject(top, commit)

    def skipped(why: str) -> Step:
        return Step(
            commit=commit,
            subject=title,
            status="skipped",
            wall_s=time.monotonic() - started,
            why=why,
        )

    work = settings.work_dir / "bisect"
    with checkout(top, commit, work / "tree") as (tree, _label):
        pairs: list[PairSpec] = []
        for name in experiments:
            path = Path(name) if Path(name).is_absolute() else tree / name
            if not path.is_file():
                return skipped(f"no experiment file {name} in this commit")
            try:
                pairs += list(load_checked(path, rootdir=tree).pairs)
            except SpecError as exc:
                return skipped(f"the experiment does not load: {exc}")
        pair = find_pair(pairs, wanted)
        if pair is None:
            return skipped(f"no pair {wanted!r} in {', '.join(experiments)} at this commit")
        # No numerics probe: it replays both sides (a full extra run per failing step), and
        # bisect asks which commit, not which module.
        pair = dataclasses.replace(pair, probe_on_failure=False, probe_always=False)
        extra = control_code(pair, top, commit, tree)
        step_settings = in_tree_settings(
            dataclasses.replace(
                settings,
                work_dir=work / "steps" / commit[:12],
                cache_dir=settings.cache_root,
                key_extra=(extra,) if extra else (),
            ),
            tree,
        )
        with closing(SessionRunner(step_settings)) as runner:  # its fork servers end with the step
            outcome = runner.run_pair(pair)
    wall = time.monotonic() - started
    if outcome.status == "error" and outcome.control is None:
        return skipped(f"the pair cannot run: {(outcome.error or '').strip()}")
    if outcome.status == "skipped":
        return skipped(outcome.error or "the runner skipped the pair")
    return Step(
        commit=commit,
        subject=title,
        status=outcome.status,
        first_divergent_step=first_divergent_step(outcome.verdicts),
        # The runner names the last step when the verdict was decided there: an early stop
        # only when it cut the run short.
        stopped_early_at=outcome.stopped_early_at
        if outcome.stopped_early_at is not None
        and outcome.stopped_early_at < outcome.pair.test.steps
        else None,
        wall_s=wall,
        control_cached=outcome.control.cached if outcome.control else None,
        why=outcome.error or "",
        outcome=outcome,
    )


def bisect(
    top: Path,
    commits: list[str],
    *,
    experiments: list[str],
    wanted: str,
    settings: RunSettings,
    on_step: Callable[[int, Step], None] | None = None,
) -> Bisection:
    """The binary search over ``commits`` (``[GOOD, ..., BAD]``); ``on_step`` hears of each
    step as it ends, with its number (1, 2, ...)."""
    results: dict[int, Step] = {}

    def run(i: int) -> Step:
        step = run_step(top, commits[i], experiments=experiments, wanted=wanted, settings=settings)
        results[i] = step
        if on_step is not None:
            on_step(len(results), step)
        return step

    def done(**kw: Any) -> Bisection:
        order = list(results.values())
        return Bisection(
            good=commits[0],
            bad=commits[-1],
            pair=wanted,
            commits=tuple(commits),
            steps=tuple(order),
            **kw,
        )

    last = len(commits) - 1
    at_bad = run(last)
    if at_bad.status == "passed":
        return done(problem="the pair passes at BAD: nothing to bisect", ending="passes_at_bad")
    if at_bad.status == "skipped":
        return done(problem=f"the pair cannot run at BAD: {at_bad.why}", ending="cannot_run_at_bad")
    lo, hi, skipped = 0, last, set()
    while True:
        open_ = [i for i in range(lo + 1, hi) if i not in skipped]
        if not open_:
            break
        middle = (lo + hi) // 2
        i = min(open_, key=lambda j: (abs(j - middle), j))
        step = run(i)
        if step.status == "passed":
            lo = i
        elif step.bad:
            hi = i
        else:
            skipped.add(i)
    if lo == 0:
        # No commit after GOOD passed: the answer rests on GOOD passing, so check it.
        at_good = run(0)
        if at_good.bad:
            return done(
                problem=f"the pair fails at GOOD too ({at_good.status}): pick an older GOOD, "
                "a commit where it passed (the last green night's)",
                ending="fails_at_good",
            )
    left_open = tuple(commits[i] for i in range(lo + 1, hi) if i in skipped)
    return done(first_bad=commits[hi], candidates=(*left_open, commits[hi]) if left_open else ())

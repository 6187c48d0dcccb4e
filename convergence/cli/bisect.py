"""``convergence bisect GOOD BAD PAIR``: the first commit at which a pair fails.

    convergence bisect GOOD BAD PAIR [--experiment FILE ...] [--repo DIR] [--json FILE]

A binary search over the commits from GOOD (the pair passed) to BAD (it fails), first parent
only (``git rev-list --first-parent GOOD..BAD``: the merges of the main line, as the nightly
saw them). Each step checks the commit out into a worktree, as ``convergence ab`` does, loads
the experiment file *of that commit* (its pair, train config and trainer sources as they were
then) and runs the pair there -- control and test -- with the verdict pytest gives it.

- The control is the pair's own control at each commit, not a fixed reference from GOOD. Why:
  "the pair fails at C" must mean what the nightly meant, the test judged against the control
  of the same code; a commit that moves both sides the same way (a new init, a data change) is
  not a failure, and a GOOD reference would blame it. The cost is kept down by the run cache:
  the control's key covers the code it runs (the trainer's ``backend_options.sources``, the
  hook's package at that commit), so a control whose code did not change between two steps
  runs once (:func:`control_code`). Where the key could not tell (a command trainer that names
  no sources, a torchtitan checkout), the commit goes into the key: correct, not reused.
- The test stops as soon as the sequential monitor has decided (the runner's early stop), and
  no numerics probe runs: a broken step costs the steps up to its divergence.
- A commit where the pair cannot run (the experiment or the pair is not there, the spec does
  not load, the control does not run) is skipped, like ``git bisect skip``, and said so; a
  test job that crashes next to a healthy control counts as failing (the nightly calls it red).
- BAD is run first (its failure is the one searched for); GOOD only when the search reaches it
  without having seen a passing commit (then the answer depends on it).

Exit status: 1 the first failing commit was found (the pair fails at BAD), 0 the pair passes
at BAD (nothing to bisect), 2 invalid input (unknown ref, GOOD not an ancestor of BAD, the pair
not found or not runnable at BAD, the pair failing at GOOD too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.backends import get_backend
from convergence.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, option_values
from convergence.options import (
    OPTIONS,
    add_arguments,
    cli_run_settings,
)
from convergence.preflight import load_checked
from convergence.report.formats.failure_text import render_outcome
from convergence.run.jobs import RunSettings
from convergence.run.outcome import PairOutcome
from convergence.run.probe import first_divergent_step
from convergence.run.session import SessionRunner
from convergence.spec.errors import SpecError
from convergence.spec.pair import PairSpec
from convergence.worktrees import checkout, git, git_ok, in_tree_settings, sigterm_as_interrupt

#: Session options ``bisect`` takes (not tier/alpha/report/strict: one pair, its own verdict).
BISECT_OPTIONS = (
    "workdir",
    "steps",
    "devices",
    "launcher",
    "idle-limit",
    "wall-limit",
    "cache-dir",
    "refresh",
    "no-early-stop",
)


def add_bisect_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bisect = sub.add_parser(
        "bisect",
        help="find the first commit at which a pair fails (binary search, git worktrees)",
        description=__doc__.split("\n\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bisect.add_argument("good", metavar="GOOD", help="a commit where the pair passed")
    bisect.add_argument("bad", metavar="BAD", help="a later commit where it fails")
    bisect.add_argument(
        "pair",
        metavar="PAIR",
        help="the pair: its id as reports print it (exp.toml::fsdp2) or its test's name",
    )
    bisect.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="FILE",
        help="experiment file(s) to find PAIR in, read at each commit (default: the file "
        "the pair id names, looked up in BAD)",
    )
    bisect.add_argument("--repo", default=".", metavar="DIR", help="the trainer's git repository")
    bisect.add_argument("--json", metavar="FILE", help="also write the steps and answer as JSON")
    add_arguments(bisect, skip=[opt.name for opt in OPTIONS if opt.name not in BISECT_OPTIONS])
    bisect.set_defaults(func=cmd_bisect)


# -- the steps ------------------------------------------------------------------------------


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

    def line(self, number: int) -> str:
        parts = [f"[{number}] {self.commit[:10]} {self.subject[:50]!r}: {self.status.upper()}"]
        if self.first_divergent_step is not None:
            parts.append(f"first divergent step {self.first_divergent_step}")
        if self.stopped_early_at is not None:
            parts.append(f"stopped early at step {self.stopped_early_at}")
        if self.control_cached is not None:
            parts.append("control from cache" if self.control_cached else "control ran")
        parts.append(f"{self.wall_s:.1f} s")
        text = ", ".join(parts)
        if self.status == "skipped":
            text += f"\n    skipped (like git bisect skip): {self.why}"
        elif self.status == "error":
            text += f"\n    {self.why.splitlines()[0] if self.why else 'error'}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "subject": self.subject,
            "status": self.status,
            "first_divergent_step": self.first_divergent_step,
            "stopped_early_at": self.stopped_early_at,
            "wall_s": round(self.wall_s, 3),
            "control_cached": self.control_cached,
            "why": self.why or None,
        }


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
    exit_status: int = EXIT_FAILED

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
            "exit_status": self.exit_status,
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


def _subject(top: Path, commit: str) -> str:
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
    subject = _subject(top, commit)

    def skipped(why: str) -> Step:
        return Step(
            commit=commit,
            subject=subject,
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
        outcome = SessionRunner(step_settings).run_pair(pair)
    wall = time.monotonic() - started
    if outcome.status == "error" and outcome.control is None:
        return skipped(f"the pair cannot run: {(outcome.error or '').strip()}")
    if outcome.status == "skipped":
        return skipped(outcome.error or "the runner skipped the pair")
    return Step(
        commit=commit,
        subject=subject,
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
    say: Any = print,
) -> Bisection:
    """The binary search over ``commits`` (``[GOOD, ..., BAD]``)."""
    results: dict[int, Step] = {}

    def run(i: int) -> Step:
        step = run_step(top, commits[i], experiments=experiments, wanted=wanted, settings=settings)
        results[i] = step
        say(step.line(len(results)))
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
        return done(problem="the pair passes at BAD: nothing to bisect", exit_status=EXIT_OK)
    if at_bad.status == "skipped":
        return done(problem=f"the pair cannot run at BAD: {at_bad.why}", exit_status=EXIT_USAGE)
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
                exit_status=EXIT_USAGE,
            )
    left_open = tuple(commits[i] for i in range(lo + 1, hi) if i in skipped)
    return done(first_bad=commits[hi], candidates=(*left_open, commits[hi]) if left_open else ())


# -- the command ----------------------------------------------------------------------------


def _dirty(top: Path) -> bool:
    return bool(git(top, "status", "--porcelain", "--untracked-files=no"))


def cmd_bisect(args: argparse.Namespace) -> int:
    values = option_values(args, "bisect")
    if values is None:
        return EXIT_USAGE
    settings = cli_run_settings(values)
    top = Path(git(Path(args.repo), "rev-parse", "--show-toplevel"))
    commits = commits_between(top, args.good, args.bad)
    experiments = experiment_paths(top, commits[-1], args.pair, args.experiment, Path.cwd())
    if _dirty(top):
        print(
            f"note: {top} has uncommitted changes; bisect runs each commit in a worktree of "
            "its own and does not see them (commit them to have them bisected)",
            file=sys.stderr,
        )
    print(
        f"bisecting {args.pair}: {len(commits) - 1} commit(s) after {args.good} "
        f"({commits[0][:10]}) up to {args.bad} ({commits[-1][:10]}), "
        # BAD, then a binary search over the commits between: 1 + ceil(log2(n)) runs for n
        # commits (one more when the search reaches GOOD; one per skipped commit).
        f"about {1 + (len(commits) - 2).bit_length()} pair run(s)",
        flush=True,
    )
    with sigterm_as_interrupt():  # a killed bisect still removes its worktree and jobs
        result = bisect(
            top,
            commits,
            experiments=experiments,
            wanted=args.pair,
            settings=settings,
            say=lambda text: print(text, flush=True),
        )
    print(render_result(result, top))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1) + "\n")
    if result.exit_status == EXIT_USAGE:
        print(f"error: {result.problem}", file=sys.stderr)
    return result.exit_status


def render_result(result: Bisection, top: Path) -> str:

    runs = f"{len(result.steps)} pair run(s) for {len(result.commits) - 1} commit(s)"
    if result.first_bad is None:
        return f"no answer ({runs}): {result.problem}"
    step = next(s for s in result.steps if s.commit == result.first_bad)
    lines = []
    if result.candidates:
        lines.append(
            f"the first failing commit is one of {len(result.candidates)} ({runs}; the "
            "others could not run):"
        )
        lines += [f"  {c[:10]} {_subject(top, c)}" for c in result.candidates]
    else:
        lines.append(f"first bad commit: {result.first_bad} ({runs})")
        lines.append(f"  {step.subject}")
    verdict = f"  verdict: {step.status.upper()}"
    if step.first_divergent_step is not None:
        verdict += f", first divergent step {step.first_divergent_step}"
    lines.append(verdict)
    if step.outcome is not None and step.status != "passed":
        lines.append(step.outcome.error or render_outcome(step.outcome))
    return "\n".join(lines)

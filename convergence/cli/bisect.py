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
import json
import sys
from pathlib import Path

from convergence.bisection import (
    Bisection,
    Ending,
    Step,
    bisect,
    commits_between,
    experiment_paths,
    subject,
)
from convergence.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, add_job_options, option_values
from convergence.options import cli_run_settings
from convergence.report.formats.failure_text import render_outcome
from convergence.worktrees import git, sigterm_as_interrupt

#: The exit status of each way a search ends (the module's docstring says them).
EXIT_STATUS: dict[Ending, int] = {
    "found": EXIT_FAILED,
    "passes_at_bad": EXIT_OK,
    "cannot_run_at_bad": EXIT_USAGE,
    "fails_at_good": EXIT_USAGE,
}


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
    # The job options and the cache's, early stop (not tier/alpha/report/strict: one pair, its
    # own verdict).
    add_job_options(bisect, "cache-dir", "refresh", "no-early-stop")
    bisect.set_defaults(func=cmd_bisect)


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
            on_step=lambda number, step: print(step_line(step, number), flush=True),
        )
    status = EXIT_STATUS[result.ending]
    print(render_result(result, top))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        answer = {**result.to_json(), "exit_status": status}
        Path(args.json).write_text(json.dumps(answer, indent=1) + "\n")
    if status == EXIT_USAGE:
        print(f"error: {result.problem}", file=sys.stderr)
    return status


def step_line(step: Step, number: int) -> str:
    parts = [f"[{number}] {step.commit[:10]} {step.subject[:50]!r}: {step.status.upper()}"]
    if step.first_divergent_step is not None:
        parts.append(f"first divergent step {step.first_divergent_step}")
    if step.stopped_early_at is not None:
        parts.append(f"stopped early at step {step.stopped_early_at}")
    if step.control_cached is not None:
        parts.append("control from cache" if step.control_cached else "control ran")
    parts.append(f"{step.wall_s:.1f} s")
    text = ", ".join(parts)
    if step.status == "skipped":
        text += f"\n    skipped (like git bisect skip): {step.why}"
    elif step.status == "error":
        text += f"\n    {step.why.splitlines()[0] if step.why else 'error'}"
    return text


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
        lines += [f"  {c[:10]} {subject(top, c)}" for c in result.candidates]
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

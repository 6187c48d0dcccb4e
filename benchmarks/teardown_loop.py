"""Teardown aborts of short gloo jobs: with the shared clean exit vs a plain interpreter exit.

    python benchmarks/teardown_loop.py [--jobs 30] [--nproc 4] [--modes helper,plain]

Runs ``--jobs`` torchrun jobs of ``tests/fixtures/teardown_worker.py`` (DDP steps and async
collectives on gloo) per exit mode and counts jobs in which a rank aborted at exit
("terminate called without an active exception" / SIGABRT) or failed otherwise. ``helper``
leaves through :mod:`convergence.dist_exit`; ``plain`` destroys the process group and lets the
interpreter finalize, as every worker did before. Prints a table and writes the
``teardown-loop`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "fixtures" / "teardown_worker.py"
ABORT_TEXT = "terminate called without an active exception"


@dataclass(frozen=True, kw_only=True)
class LoopResult:
    mode: str
    jobs: int
    nproc: int
    aborted: int
    """Jobs in which at least one rank aborted at exit (SIGABRT or the terminate line)."""
    failed: int
    """Jobs that failed for any other reason."""
    wall_s: float
    first_abort: str = ""
    """The first abort's output tail, for the reader."""


def run_one(
    mode: str, nproc: int, *, steps: int = 3, timeout_s: float = 300.0
) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--steps",
        str(steps),
        "--exit",
        mode,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO
    )


def is_abort(proc: subprocess.CompletedProcess[str]) -> bool:
    text = proc.stdout + proc.stderr
    return ABORT_TEXT in text or "SIGABRT" in text or proc.returncode == -6


def run_loop(mode: str, *, jobs: int, nproc: int) -> LoopResult:
    aborted = failed = 0
    first = ""
    start = time.monotonic()
    for _ in range(jobs):
        proc = run_one(mode, nproc)
        if is_abort(proc):
            aborted += 1
            first = first or (proc.stdout + proc.stderr)[-1500:]
        elif proc.returncode != 0:
            failed += 1
    return LoopResult(
        mode=mode,
        jobs=jobs,
        nproc=nproc,
        aborted=aborted,
        failed=failed,
        wall_s=time.monotonic() - start,
        first_abort=first,
    )


def table(results: list[LoopResult]) -> str:
    lines = [
        "| exit | jobs x ranks | aborted at exit | other failures | wall |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.jobs} x {r.nproc} | {r.aborted} | {r.failed} | {r.wall_s:.0f} s |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--modes", default="helper,plain")
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = parser.parse_args()
    results = [run_loop(mode, jobs=args.jobs, nproc=args.nproc) for mode in args.modes.split(",")]
    text = table(results)
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from _report import machine, write_section

        write_section(
            "teardown-loop",
            (
                f"## Teardown aborts of short gloo jobs ({time.strftime('%Y-%m-%d')}, "
                "benchmarks/teardown_loop.py)\n\n"
                "Each job: torchrun, DDP on gloo for 3 steps with async collectives, then exit. "
                "`helper` leaves through `convergence.dist_exit` (process group destroyed, stdio "
                "flushed, `os._exit`), as the trainer and every fixture worker now do; `plain` "
                "destroys the process group and lets the interpreter finalize.\n\n"
                f"{text}\n\nMachine: {machine()}."
            ),
        )
    return 1 if any(r.aborted for r in results if r.mode == "helper") else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Soak: many small pairs, a third of them faulty, through pytest (one process, then -n 2).

Every pair runs the faulty trainer (tests/fixtures/faulty/trainer.py) under real torchrun via the
command backend. Faults rotate through: a rank raises, a rank is SIGKILLed, NaN loss, inf loss,
a rank hangs (ended by a short --convergence-idle-limit). Reported: pairs run, faults contained
(each faulty pair ended as error/failed with its own message, each good pair passed), processes
of any job still alive afterwards (by PID: the launcher's pids.json and the PIDs the ranks
wrote), wall time. Writes the ``soak`` section of BENCHMARKS.md.

    python benchmarks/soak.py [--pairs 30] [--idle-limit 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "faulty"))

from _report import machine, write_section  # noqa: E402
from faulty_project import (FaultyTest, alive, experiment, job_pids, kill_pids,  # noqa: E402
                            make_project, odd_config, run_dirs, run_pytest, saved_outcomes)

FAULTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    # kind: (trainer options, pair status, text the error must hold)
    "raise": (("--fault", "raise", "--fault-rank", "1", "--at", "2"), "error",
              "rank 1 failed: RuntimeError: injected fault"),
    "sigkill": (("--fault", "sigkill", "--fault-rank", "1", "--at", "2"), "error",
                "rank 1 was killed by SIGKILL"),
    "nan": (("--fault", "nan", "--at", "2"), "failed", "loss is nan at step 2"),
    "inf": (("--fault", "inf", "--at", "3"), "failed", "loss is inf at step 3"),
    "hang": (("--fault", "hang", "--fault-rank", "1", "--at", "2"), "error", "hung: no new line"),
}


def plan(num_pairs: int) -> list[tuple[FaultyTest, str | None]]:
    """Every third pair is faulty, the kinds in turn."""
    kinds = list(FAULTS)
    out: list[tuple[FaultyTest, str | None]] = []
    for i in range(num_pairs):
        if i % 3 == 2:
            kind = kinds[(i // 3) % len(kinds)]
            out.append((FaultyTest(name=f"p{i:02d}-{kind}", fault_args=FAULTS[kind][0],
                                   early_stop=False), kind))
        else:
            out.append((FaultyTest(name=f"p{i:02d}-ok"), None))
    return out


def soak(root: Path, num_pairs: int, idle_limit: float, workers: int | None) -> dict[str, object]:
    pairs = plan(num_pairs)
    project = make_project(root, {"soak.toml": experiment(
        tests=[t for t, _ in pairs], train_config=odd_config(root), steps=4)})
    args = [f"--convergence-idle-limit={idle_limit}", "-q"]
    if workers:
        args += ["-n", str(workers), "--convergence-devices", str(2 * workers)]
    started = time.monotonic()
    proc = run_pytest(project, *args, timeout=3600)
    wall = time.monotonic() - started
    workdir = project / ".convergence"
    outcomes = saved_outcomes(workdir)
    contained = good = 0
    problems = []
    for test, kind in pairs:
        o = outcomes.get(test.name)
        if o is None:
            problems.append(f"{test.name}: no outcome")
            continue
        if kind is None:
            good += o["status"] == "passed"
            if o["status"] != "passed":
                problems.append(f"{test.name}: {o['status']} {o['error']}")
            continue
        _, status, text = FAULTS[kind]
        if o["status"] == status and text in (o["error"] or ""):
            contained += 1
        else:
            problems.append(f"{test.name}: {o['status']} {(o['error'] or '')[:200]}")
    pids: set[int] = set()
    for run_dir in run_dirs(workdir):
        pids |= job_pids(run_dir)
    left = alive(pids)
    kill_pids(left)
    return {"workers": workers or 1, "pairs": len(outcomes), "planned": num_pairs,
            "faulty": sum(k is not None for _, k in pairs), "contained": contained,
            "good_passed": good, "good": sum(k is None for _, k in pairs),
            "pids_checked": len(pids), "leftover": len(left), "wall_s": wall,
            "exit": proc.returncode, "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--idle-limit", type=float, default=30.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for workers in (None, 2):
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            row = soak(Path(tmp), args.pairs, args.idle_limit, workers)
        print(row, flush=True)
        rows.append(row)
    lines = [
        f"{args.pairs} pairs (command backend, 2 ranks per job under real torchrun, 4 steps), "
        f"every third one faulty (rank raises, rank SIGKILLed, NaN loss, inf loss, rank hangs; "
        f"--convergence-idle-limit {args.idle_limit:g}), run by "
        "`python benchmarks/soak.py`.", "",
        "| run | pairs run | faults contained | good pairs passed | PIDs audited | "
        "leftover processes | wall |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'-n ' + str(r['workers']) if r['workers'] > 1 else 'one process'} | "
                     f"{r['pairs']}/{r['planned']} | {r['contained']}/{r['faulty']} | "
                     f"{r['good_passed']}/{r['good']} | {r['pids_checked']} | {r['leftover']} | "
                     f"{r['wall_s']:.0f} s |")
    problems = [p for r in rows for p in r["problems"]]  # type: ignore[attr-defined]
    if problems:
        lines += ["", "Not as expected:", *[f"- {p}" for p in problems]]
    lines += ["", f"Machine: {machine()}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section("soak", text)


if __name__ == "__main__":
    main()

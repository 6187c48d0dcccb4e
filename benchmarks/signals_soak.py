"""Soak of the session faults: pytest itself stopped by SIGTERM, SIGINT or SIGKILL mid-job.

What a Slurm `scancel`, a CI timeout, a Ctrl-C and an OOM killer do to a running session. Each
trial starts pytest (one process, or -n 2) on a pair whose control finishes (2 steps) and whose
test trains until stopped, waits until the test has logged a step, sends the signal to pytest's
process alone (not its group: that is what runners do), and then checks:

- pytest exited (and how long after the signal);
- SIGTERM/SIGINT: report.json was written and says `interrupted`, and lists the pair in flight
  as interrupted; the finished control's run-cache entry exists (a finished result is never
  lost: the next session reuses it);
- every process pytest had started (torchrun agents, ranks, xdist workers; captured before the
  signal) is gone 15 s later -- for SIGKILL only the kernel's parent-death signal can do that.

Prints a table and writes the ``signals-soak`` section of BENCHMARKS.md.

    python benchmarks/signals_soak.py [--repeats 3]      # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, write_section

# The control finishes (2 steps); the test trains (practically) forever, so the signal always
# lands mid-job with one finished result to keep.
EXPERIMENT = """
[defaults]
train_config = "debug"
steps = 100000
seed = 3

[control]
name = "ddp2"
parallelism = { dp_replicate = 2 }
steps = 2

[[test]]
name = "fsdp2-long"
parallelism = { dp_shard = 2 }
early_stop = false
"""
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}


@dataclass(frozen=True, kw_only=True)
class Trial:
    signal: str
    workers: int
    exited_s: float | None
    """Seconds from the signal to pytest's exit (None: still running after 180 s)."""
    report_interrupted: bool | None
    """report.json written and marked interrupted (None: not expected, SIGKILL)."""
    control_kept: bool | None
    """The finished control is in the run cache and the pair in flight is listed in
    report.json as interrupted (SIGKILL: no report, the cache entry is checked alone)."""
    processes: int
    leftover: int


def _default_sigint() -> None:
    # A shell's `&` leaves SIGINT ignored in background children; pytest must see it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def trial(root: Path, sig: str, workers: int) -> Trial:
    (root / "experiments").mkdir(parents=True)
    (root / "experiments" / "forever.toml").write_text(EXPERIMENT)
    (root / "pytest.ini").write_text("[pytest]\n")
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-m",
        "convergence",
        "--convergence-report",
        "report",
        "-q",
    ]
    if workers > 1:
        argv += ["-n", str(workers)]
    with open(root / "out.txt", "w") as out:
        proc = subprocess.Popen(
            argv,
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if any(
            p.stat().st_size for p in root.glob(".convergence/runs/*/test-*/dump/metrics.jsonl")
        ):
            break
        time.sleep(0.5)
    processes = psutil.Process(proc.pid).children(recursive=True)
    sent = time.monotonic()
    os.kill(proc.pid, SIGNALS[sig])
    try:
        proc.wait(timeout=180)
        exited: float | None = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        exited = None
        proc.kill()
    _, alive = psutil.wait_procs(processes, timeout=15)
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    cached = any((root / ".convergence" / "cache").glob("??/*/manifest.json"))
    report_path = root / "report" / "report.json"
    interrupted = kept = None
    if sig != "SIGKILL":
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        interrupted = bool(report.get("environment", {}).get("interrupted"))
        # The finished control is in the run cache, and the pair in flight is listed in the
        # report as interrupted (not silently dropped).
        kept = cached and any(
            "interrupted" in (p.get("error") or "") for p in report.get("pairs", [])
        )
    else:
        kept = cached
    return Trial(
        signal=sig,
        workers=workers,
        exited_s=exited,
        report_interrupted=interrupted,
        control_kept=kept,
        processes=len(processes),
        leftover=len(left),
    )


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    start = time.monotonic()
    trials = []
    for sig in SIGNALS:
        for workers in (1, 2):
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="signals-soak-") as tmp:
                    t = trial(Path(tmp), sig, workers)
                print(t, flush=True)
                trials.append(t)
    rows = [
        "| signal to pytest | run | trials | exited (max s after the signal) | "
        "report written, interrupted | control cached, pair listed | processes audited | "
        "leftover after 15 s |",
        "|---|---|---:|---:|---|---|---:|---:|",
    ]
    for sig in SIGNALS:
        for workers in (1, 2):
            group = [t for t in trials if t.signal == sig and t.workers == workers]
            exits = [t.exited_s for t in group]
            worst = "never" if None in exits else f"{max(e for e in exits if e is not None):.1f}"
            reports = [t.report_interrupted for t in group]
            kept = [t.control_kept for t in group]
            rows.append(
                f"| {sig} | {'-n 2' if workers > 1 else 'one process'} | {len(group)} | "
                f"{sum(e is not None for e in exits)}/{len(group)} ({worst}) | "
                f"{'-' if reports[0] is None else f'{sum(bool(r) for r in reports)}/{len(group)}'}"
                f" | {sum(bool(k) for k in kept)}/{len(group)} | "
                f"{sum(t.processes for t in group)} | {sum(t.leftover for t in group)} |"
            )
    body = "\n".join(
        [
            "## Session faults: pytest stopped mid-job (benchmarks/signals_soak.py)",
            "",
            f"Machine: {machine()}. `python benchmarks/signals_soak.py --repeats {args.repeats}`: "
            "a finished control (DDP2, 2 steps) and a test (FSDP2) that trains until stopped; the "
            "signal goes to pytest's process alone once the test logged a step. SIGKILL writes no "
            "report (no handler runs); its jobs end through the parent-death signal.",
            "",
            *rows,
            "",
            f"Whole run: {(time.monotonic() - start) / 60:.1f} min.",
        ]
    )
    print("\n" + body)
    if not args.no_write:
        write_section("signals-soak", body)
    bad = (
        sum(t.leftover for t in trials)
        + sum(t.exited_s is None for t in trials)
        + sum(t.report_interrupted is False or t.control_kept is False for t in trials)
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Wall time of whole sessions, before and after a change: the quick start and a bf16 twin pair.

Each run is ``pytest -m convergence`` in a subprocess with a cold cache (a fresh
``--convergence-workdir``), the code of one checkout first on PYTHONPATH:

- ``quick start``: the README's (experiments/quickstart.toml, run from the checkout: 3 paired
  fp32 pairs, one control job, 30 steps);
- ``bf16 twin pair``: one pair of the twin regime (control FSDP(2) with bf16 params, test
  FSDP(2)+TP(2), 30 steps): its control, noise twin (FSDP(4)) and forward-noise twin are the
  control-side jobs that issue 39 runs at once where the device pool has room;
- ``torchtitan``: experiments/torchtitan/cpu.toml at the ci tier (torchtitan 0.3.0 on CPU: one
  control, FSDP2+TP2+SP and FSDP2+PP2 1F1B, 4 steps), where torchtitan is installed: what the
  warm start's backend imports (``Capabilities.warm_imports``) save.

``before`` is a source tree of ``--before REV`` (``git archive``), ``after`` this checkout. Runs
are interleaved (before, after, before, ...) per round so a drift of the machine's load hits
both alike; each run notes the 1-min load at its start. CPU is the user+system time of every
process of the session.

    python benchmarks/pair_wall.py --before REV [--rounds 2] [--only quickstart,twin]
        [--no-append]

Writes the ``pair-wall`` section of BENCHMARKS.md unless --no-append.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from _report import REPO, machine, write_section

WORKLOADS = ("quickstart", "twin", "torchtitan")
TITLES = {
    "quickstart": "quick start (3 pairs)",
    "twin": "bf16 twin pair",
    "torchtitan": "torchtitan cpu.toml (2 pairs)",
}
#: What a workload adds to ``pytest -m convergence`` (run from the checkout).
WORKLOAD_ARGS = {"torchtitan": ["--convergence-tier", "ci", "experiments/torchtitan/cpu.toml"]}

TWIN_EXPERIMENT = """\
[experiment]
description = "one bf16 pair: the twin regime runs the control, its twin and forward twin"
tier = "quick"

[defaults]
train_config = "debug"
steps = 30
seed = 42
techniques = { param_dtype = "bfloat16" }

[control]
name = "fsdp2"
parallelism = { dp_shard = 2 }

[[test]]
name = "fsdp2-tp2"
parallelism = { dp_shard = 2, tp = 2 }
"""


def source_tree(rev: str, into: Path) -> Path:
    """The repository's files at ``rev`` (no .git), in ``into``."""
    data = subprocess.run(
        ["git", "archive", "--format=tar", rev], cwd=REPO, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def session(checkout: Path, workload: str, work: Path) -> dict[str, float | str]:
    """One cold-cache session of ``workload`` with ``checkout``'s code."""
    if workload in ("quickstart", "torchtitan"):
        cwd = checkout
    else:
        cwd = work / "project"
        (cwd / "experiments").mkdir(parents=True)
        (cwd / "experiments" / "twin.toml").write_text(TWIN_EXPERIMENT)
        (cwd / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "convergence",
        "-p",
        "no:cacheprovider",
        "--convergence-workdir",
        str(work / "wd"),
        "-q",
        *WORKLOAD_ARGS.get(workload, []),
    ]
    load = os.getloadavg()[0]
    cpu0, t0 = _children_cpu(), time.monotonic()
    with open(work / "pytest.log", "w") as log:
        proc = subprocess.run(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    tail = (work / "pytest.log").read_text().strip().splitlines()[-1:]
    return {
        "wall": wall,
        "cpu": cpu,
        "load": load,
        "rc": proc.returncode,
        "result": tail[0] if tail else "",
    }


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' code")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    workloads = [w for w in args.only.split(",") if w]
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.before], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    runs: dict[tuple[str, str], list[dict[str, float | str]]] = {}
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pair-wall-") as tmp:
        root = Path(tmp)
        checkouts = {"before": source_tree(args.before, root / "before"), "after": REPO}
        for n in range(args.rounds):
            for workload in workloads:
                for side, checkout in checkouts.items():
                    work = root / f"{workload}-{side}-{n}"
                    work.mkdir()
                    result = session(checkout, workload, work)
                    runs.setdefault((workload, side), []).append(result)
                    print(f"round {n + 1} {workload} {side}: {result}", flush=True)
    lines = [
        "| session | before wall s | after wall s | before CPU s | after CPU s | 1-min load "
        "at the runs' starts | pytest's result (after) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in workloads:
        before, after = runs[(workload, "before")], runs[(workload, "after")]
        loads = [float(r["load"]) for r in before + after]
        lines.append(
            f"| {TITLES[workload]} | {_spread([float(r['wall']) for r in before])} | "
            f"{_spread([float(r['wall']) for r in after])} | "
            f"{_spread([float(r['cpu']) for r in before])} | "
            f"{_spread([float(r['cpu']) for r in after])} | "
            f"{min(loads):.0f}-{max(loads):.0f} | {after[-1]['result']} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.no_append:
        return
    body = (
        "### Session wall time, before and after (benchmarks/pair_wall.py)\n\n"
        f"`python benchmarks/pair_wall.py --before {args.before} --rounds {args.rounds}`: "
        f"`pytest -m convergence`, cold cache, before = {rev.strip()}, after = "
        f"{head.strip()} (and the working tree), {args.rounds} interleaved rounds; median "
        f"(min-max). Machine: {machine()}; 1-min load {start_load:.1f} at the start.\n\n"
        f"{table}\n"
    )
    write_section("pair-wall", body)


if __name__ == "__main__":
    main()

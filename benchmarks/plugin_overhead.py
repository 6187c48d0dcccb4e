"""End-to-end overhead of the plugin: the quick start under pytest vs the same jobs by hand.

"By hand" is what a careful user would do without us: create the seed checkpoint once (one
process), then run the control and the three tests one after the other with torchrun, every job
loading that seed checkpoint (the argv and environment the built-in backend and LocalLauncher
use, so the jobs themselves are identical). "Plugin" is ``pytest -m convergence`` from the
repository root with a cold run cache and early stopping off (so it also runs every job to its
end): collection, validation, the seed checkpoint, the launcher's watching, verdicts, the
terminal matrix and, with ``--convergence-report``, the report files and plots.

Each round runs, in this order: by hand, pytest, pytest with ``--convergence-report``, so a
drift in machine load hits every side alike; at least 3 rounds, and every side's spread over
the rounds is printed next to its mean (the difference between the sides is only worth what
that spread allows). The fixed costs are measured apart, each round: collection alone
(``pytest -m convergence --collect-only``) and the report alone (``convergence report --from``
the round's saved outcomes, a fresh process: imports, plots, documents). The per-pair cost is
what remains of the plugin's extra time once those fixed costs are taken out, over the pairs.
Each round is also checked against issue 30's target: the plugin with the report adds at most
3 % plus 1 s per pair to the by-hand wall time.

    python benchmarks/plugin_overhead.py [--rounds 3] [--no-append]

Wall time and CPU time (of this process's children, i.e. every rank) per side, the 1-min load
average before and after each round. Prints the tables and writes its section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import machine, write_section

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.toml"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str], *, env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run ``argv`` to its end; (wall s, CPU s of it and all its descendants)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start, cpu0 = time.monotonic(), _children_cpu()
    with log.open("wb") as out:
        rc = subprocess.run(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    wall, cpu = time.monotonic() - start, _children_cpu() - cpu0
    if rc != 0:
        raise SystemExit(f"{argv[:4]}... failed (rc {rc}); see {log}")
    return wall, cpu


def by_hand(work: Path) -> tuple[float, float, int]:
    """The seed checkpoint, then every job of the quick start with torchrun, in order."""
    from convergence.backends.builtin import BuiltinBackend
    from convergence.launch.torchrun import build_torchrun_argv, job_env
    from convergence.launch.types import LaunchRequest
    from convergence.preflight import load_checked

    pairs = load_checked(QUICKSTART, rootdir=REPO).pairs
    jobs = [pairs[0].control, *(pair.test for pair in pairs)]
    backend = BuiltinBackend()
    seed_dir = work / "seed"
    seed = LaunchRequest(
        name="seed",
        entry=backend.seed_entry(jobs[0], seed_dir),
        nproc=1,
        log_dir=work / "seed-logs",
        direct=True,
    )
    wall, cpu = _timed(build_torchrun_argv(seed), env=job_env(seed), log=work / "seed.log")
    for job in jobs:
        run = work / job.name
        request = LaunchRequest(
            name=job.name,
            entry=backend.train_entry(job, run / "dump", seed_dir),
            nproc=job.world_size,
            log_dir=run / "logs",
        )
        w, c = _timed(build_torchrun_argv(request), env=job_env(request), log=run / "out.log")
        wall, cpu = wall + w, cpu + c
    return wall, cpu, len(pairs)


def under_pytest(work: Path, *, report: bool) -> tuple[float, float]:
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
        "--convergence-no-early-stop",
        "-q",
    ]
    if report:
        argv += ["--convergence-report", str(work / "report")]
    return _timed(argv, env=dict(os.environ), log=work / "pytest.log")


def collect_only(work: Path) -> float:
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "convergence",
        "-p",
        "no:cacheprovider",
        "--collect-only",
        "-q",
        "--convergence-workdir",
        str(work / "wd-collect"),
    ]
    return _timed(argv, env=dict(os.environ), log=work / "collect.log")[0]


def report_alone(plugin_work: Path, out: Path) -> float:
    """`convergence report --from` the outcomes the plugin run saved: the report's cost."""
    saved = sorted(plugin_work.rglob("*.outcome.json"))
    if not saved:
        raise SystemExit(f"no saved outcomes under {plugin_work}")
    argv = [
        sys.executable,
        "-m",
        "convergence.cli",
        "report",
        "--from",
        str(saved[0].parent),
        "--out",
        str(out),
    ]
    return _timed(argv, env=dict(os.environ), log=out.parent / "report-alone.log")[0]


SIDES = ("hand", "plugin", "plugin+report")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (at least 3)")
    p.add_argument("--no-append", action="store_true", help="do not write BENCHMARKS.md")
    args = p.parse_args()
    if args.rounds < 3:
        p.error("--rounds must be at least 3: fewer cannot tell noise from cost")
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    collect: list[float] = []
    report: list[float] = []
    loads: list[tuple[float, float]] = []
    num_pairs = 0
    with tempfile.TemporaryDirectory(prefix="plugin-overhead-") as tmp:
        for i in range(args.rounds):
            load0 = os.getloadavg()[0]
            root = Path(tmp) / f"round{i}"
            wall, cpu, num_pairs = by_hand(root / "hand")
            runs["hand"].append((wall, cpu))
            runs["plugin"].append(under_pytest(root / "plugin", report=False))
            runs["plugin+report"].append(under_pytest(root / "plugin-report", report=True))
            collect.append(collect_only(root))
            report.append(report_alone(root / "plugin", root / "report-alone" / "out"))
            loads.append((load0, os.getloadavg()[0]))
            print(
                f"round {i + 1}: "
                + ", ".join(f"{side} {runs[side][-1][0]:.1f} s" for side in SIDES)
                + f", collection {collect[-1]:.1f} s, report {report[-1]:.1f} s, "
                f"load {load0:.1f} -> {loads[-1][1]:.1f}",
                flush=True,
            )
    text = _tables(runs, collect, report, loads, num_pairs)
    print(text)
    if args.no_append:
        return
    section = (
        f"\n## Plugin overhead, end to end ({time.strftime('%Y-%m-%d')}, "
        f"benchmarks/plugin_overhead.py)\n\n"
        f"`python benchmarks/plugin_overhead.py --rounds {args.rounds}` — the quick start "
        f"({num_pairs} pairs: control fsdp2 on 2 ranks, three tests on 4 ranks, 30 steps) under "
        f"`pytest -m convergence` (cold cache, early stop off), without and with "
        f"`--convergence-report`, vs the seed checkpoint and the same 4 torchrun jobs run one "
        f"after the other by hand; rounds alternate hand, plugin, plugin+report. CPU is the "
        f"user+system time of every process of the side (all ranks).\n\n"
        f"Machine: {machine()}. 1-min load average before/after each round: "
        f"{', '.join(f'{a:.1f}/{b:.1f}' for a, b in loads)}.\n\n{text}\n"
    )
    write_section("plugin_overhead", section)
    print(f"wrote the plugin-overhead section of {REPO / 'BENCHMARKS.md'}")


def _spread(values: list[float], digits: int = 1) -> str:
    mean, low, high = statistics.mean(values), min(values), max(values)
    return f"{mean:.{digits}f} ({low:.{digits}f} to {high:.{digits}f})"


def _tables(
    runs: dict[str, list[tuple[float, float]]],
    collect: list[float],
    report: list[float],
    loads: list[tuple[float, float]],
    num_pairs: int,
) -> str:
    hand = [w for w, _ in runs["hand"]]
    rows = [
        "| side | wall s, mean (range) | CPU s, mean (range) | adds, wall | adds, CPU | "
        "per pair, wall |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for side in SIDES:
        wall, cpu = [w for w, _ in runs[side]], [c for _, c in runs[side]]
        name = {
            "hand": "by hand (seed checkpoint + 4 torchrun jobs)",
            "plugin": "pytest -m convergence",
            "plugin+report": "pytest -m convergence --convergence-report DIR",
        }[side]
        if side == "hand":
            rows.append(f"| {name} | {_spread(wall)} | {_spread(cpu)} | | | |")
            continue
        added = statistics.mean(wall) - statistics.mean(hand)
        added_cpu = statistics.mean(cpu) - statistics.mean(c for _, c in runs["hand"])
        rows.append(
            f"| {name} | {_spread(wall)} | {_spread(cpu)} | {added:+.1f} s "
            f"({added / statistics.mean(hand) * 100:+.1f} %) | {added_cpu:+.1f} s | "
            f"{added / num_pairs:+.2f} s |"
        )
    fixed = statistics.mean(collect)
    rows += [
        "",
        "| fixed and per-pair cost | wall s, mean (range) |",
        "|---|---:|",
        f"| collection alone (`--collect-only`, its own process) | {_spread(collect)} |",
        f"| report alone (`convergence report --from` the outcomes, its own process) | "
        f"{_spread(report)} |",
    ]
    for side in ("plugin", "plugin+report"):
        fixed_side = fixed + (statistics.mean(report) if side == "plugin+report" else 0.0)
        per_pair = [
            (p[0] - h - fixed_side) / num_pairs for p, h in zip(runs[side], hand, strict=True)
        ]
        rows.append(f"| {side}: per pair, fixed costs taken out | {_spread(per_pair, 2)} |")
    rows += [
        "",
        "| round | load before/after | hand (s) | plugin+report (s) | adds | "
        "target: 3 % + 1 s/pair | met |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for i, (h, (p, _)) in enumerate(zip(hand, runs["plugin+report"], strict=True)):
        target = 0.03 * h + 1.0 * num_pairs
        rows.append(
            f"| {i + 1} | {loads[i][0]:.1f}/{loads[i][1]:.1f} | {h:.1f} | {p:.1f} | "
            f"{p - h:+.1f} | {target:.1f} | {'yes' if p - h <= target else 'no'} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()

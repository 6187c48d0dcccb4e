"""End-to-end overhead of the plugin: the quick start under pytest vs the same jobs by hand.

"By hand" is what a careful user would do without us: create the seed checkpoint once (one
process), then run the control and the three tests one after the other with torchrun, every job
loading that seed checkpoint (the argv and environment the built-in backend and LocalLauncher
use, so the jobs themselves are identical). "Plugin" is ``pytest -m convergence`` from the
repository root with a cold run cache and early stopping off (so it also runs every job to its
end): collection, validation, the seed checkpoint, the launcher's watching, verdicts, the
terminal matrix and, with ``--report``, the report files and plots. Runs alternate (hand,
plugin, hand, ...) so a drift in machine load hits both sides alike.

    python benchmarks/plugin_overhead.py [--repeats 1] [--report] [--no-append]

Wall time and CPU time (of this process's children, i.e. every rank) per side; the difference
is what the plugin adds. Prints a table and writes its section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import resource
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
        rc = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            check=False).returncode
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
    seed = LaunchRequest(name="seed", entry=backend.seed_entry(jobs[0], seed_dir), nproc=1,
                         log_dir=work / "seed-logs", direct=True)
    wall, cpu = _timed(build_torchrun_argv(seed), env=job_env(seed), log=work / "seed.log")
    for job in jobs:
        run = work / job.name
        request = LaunchRequest(name=job.name, entry=backend.train_entry(job, run / "dump",
                                                                         seed_dir),
                                nproc=job.world_size, log_dir=run / "logs")
        w, c = _timed(build_torchrun_argv(request), env=job_env(request), log=run / "out.log")
        wall, cpu = wall + w, cpu + c
    return wall, cpu, len(pairs)


def under_pytest(work: Path, *, report: bool) -> tuple[float, float]:
    argv = [sys.executable, "-m", "pytest", "-m", "convergence", "-p", "no:cacheprovider",
            "--convergence-workdir", str(work / "wd"), "--convergence-no-early-stop", "-q"]
    if report:
        argv += ["--convergence-report", str(work / "report")]
    return _timed(argv, env=dict(os.environ), log=work / "pytest.log")


def collect_only(work: Path) -> float:
    argv = [sys.executable, "-m", "pytest", "-m", "convergence", "-p", "no:cacheprovider",
            "--collect-only", "-q", "--convergence-workdir", str(work / "wd-collect")]
    return _timed(argv, env=dict(os.environ), log=work / "collect.log")[0]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="hand/plugin rounds (alternating)")
    p.add_argument("--report", action="store_true", help="pytest also writes report files")
    p.add_argument("--no-append", action="store_true", help="do not write BENCHMARKS.md")
    args = p.parse_args()
    hand: list[tuple[float, float]] = []
    plugin: list[tuple[float, float]] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="plugin-overhead-") as tmp:
        for i in range(args.repeats):
            wall, cpu, num_pairs = by_hand(Path(tmp) / f"hand{i}")
            hand.append((wall, cpu))
            plugin.append(under_pytest(Path(tmp) / f"plugin{i}", report=args.report))
            print(f"round {i + 1}: hand {wall:.1f} s, plugin {plugin[-1][0]:.1f} s", flush=True)
        collect = collect_only(Path(tmp))
    load_after = os.getloadavg()[0]
    text = _table(hand, plugin, num_pairs, collect)
    print(text)
    if args.no_append:
        return
    section = (
        f"\n## Plugin overhead, end to end ({time.strftime('%Y-%m-%d')}, "
        f"benchmarks/plugin_overhead.py)\n\n"
        f"`python benchmarks/plugin_overhead.py --repeats {args.repeats}"
        f"{' --report' if args.report else ''}` — the quick start ({num_pairs} pairs: control "
        f"fsdp2 on 2 ranks, three tests on 4 ranks, 30 steps) under `pytest -m convergence` "
        f"(cold cache, early stop off) vs the seed checkpoint and the same 4 torchrun jobs run "
        f"one after the other by hand. CPU is the user+system time of every process of the "
        f"side (all ranks).\n\n"
        f"Machine: {machine()}. 1-min load average {load_before:.1f} before, "
        f"{load_after:.1f} after.\n\n{text}\n")
    write_section("plugin_overhead", section)
    print(f"wrote the plugin-overhead section of {REPO / 'BENCHMARKS.md'}")


def _table(hand: list[tuple[float, float]], plugin: list[tuple[float, float]],
           num_pairs: int, collect_s: float) -> str:
    hand_wall, hand_cpu = (sum(x[i] for x in hand) / len(hand) for i in (0, 1))
    plug_wall, plug_cpu = (sum(x[i] for x in plugin) / len(plugin) for i in (0, 1))
    rows = ["| side | wall (s) | CPU (s) |", "|---|---:|---:|",
            f"| by hand (seed checkpoint + 4 torchrun jobs) | {hand_wall:.1f} | {hand_cpu:.1f} |",
            f"| pytest -m convergence | {plug_wall:.1f} | {plug_cpu:.1f} |"]
    d_wall, d_cpu = plug_wall - hand_wall, plug_cpu - hand_cpu
    rows.append(f"| plugin adds | {d_wall:+.1f} ({d_wall / hand_wall * 100:+.1f} %) | "
                f"{d_cpu:+.1f} ({d_cpu / hand_cpu * 100:+.1f} %) |")
    rows.append(f"| per pair | {d_wall / num_pairs:+.2f} | {d_cpu / num_pairs:+.2f} |")
    rows.append(f"| collection alone (`--collect-only`, run separately) | {collect_s:.1f} | |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()

"""Where a job's time goes: the fixed cost of starting and ending it against its training steps.

One small built-in-trainer job (the debug model; on CPU 2 ranks, 3 steps, fp32; on a GPU 2 ranks
sharing it, bf16, 60 steps) is run through each way of starting a job, in interleaved rounds
(stock, torchrun, warm, stock, ...) so a drift of the machine's load hits every way alike:

- ``stock``: torchrun as torch ships it, as this project ran it before issue 39 (the agent's
  interpreter finalization, the random 0-0.3 s rendezvous sleep, 0.1 s polls);
- ``torchrun``: the project's torchrun path (``--convergence-launcher torchrun``; Slurm steps);
- ``warm``: the default local start, ranks forked from a per-session server that imported the
  distributed stack once (convergence/launch/forkserver.py); its one-off start is shown apart.

The agent, the trainer's entry and its step loop mark their phases (convergence/phase_marks.py);
the table splits each job's wall time into: the agent's import, rendezvous (until the first rank
process exists), the ranks' imports, job set-up (process group, then model/seed checkpoint/data),
the steps (first step apart: CUDA kernels and bf16 casts warm up there), and after the last step
(until the launcher returns). CPU seconds are summed over the job's processes.

    python benchmarks/job_fixed_cost.py [--rounds 3] [--device auto|cpu|cuda] [--steps N]
        [--nproc 2] [--starts stock,torchrun,warm] [--no-append]

Writes its section of BENCHMARKS.md (one per device kind) unless --no-append.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _report import REPO, machine, write_section

from convergence.launch.torchrun import MONITOR_INTERVAL_S, LocalLauncher
from convergence.launch.types import LaunchRequest
from convergence.phase_marks import ENV as PHASE_ENV

CONFIG = REPO / "train_configs" / "debug.toml"
PHASES = (
    "agent import",
    "rendezvous",
    "rank imports",
    "process group",
    "model, seed, data",
    "first step",
    "other steps",
    "after the last step",
)


class StockTorchrun(LocalLauncher):
    """torchrun as shipped (the "before" of issue 39's cheap fixes), phases marked."""

    def __init__(self) -> None:
        super().__init__(start="torchrun", poll_interval_s=0.1)

    def build_argv(self, request: LaunchRequest) -> list[str]:
        argv = super().build_argv(request)
        argv[argv.index("convergence.launch.loopback_torchrun")] = "_stock_torchrun"
        argv[argv.index(str(MONITOR_INTERVAL_S))] = "0.1"
        return argv

    def job_env(self, request: LaunchRequest) -> dict[str, str]:
        env = super().job_env(request)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p
        )
        return env


def make_launcher(start: str) -> LocalLauncher:
    if start == "stock":
        return StockTorchrun()
    return LocalLauncher(start=start)


def trainer_entry(dump: Path, seed: Path, args: argparse.Namespace, device: str) -> list[str]:
    entry = [
        "-m",
        "convergence.trainer",
        "--config",
        str(CONFIG),
        f"--training.steps={args.steps}",
        f"--parallelism.dp_shard={args.nproc}",
        f"--training.device={device}",
        f"--metrics.dump_folder={dump}",
        f"--checkpoint.seed_checkpoint={seed}",
        "--metrics.val_every=0",
    ]
    if device == "cuda":
        entry.append("--training.param_dtype=bfloat16")
    return entry


def make_seed(work: Path) -> Path:
    seed = work / "seed"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "convergence.trainer",
            "--config",
            str(CONFIG),
            "--checkpoint.create_seed_checkpoint=true",
            f"--checkpoint.seed_checkpoint={seed}",
            f"--metrics.dump_folder={work / 'seed-creator'}",
        ],
        check=True,
        capture_output=True,
    )
    return seed


def read_marks(path: Path) -> list[tuple[str, int, str, float, float]]:
    marks = []
    for line in path.read_text().splitlines():
        phase, pid, rank, at, cpu = line.split()
        marks.append((phase, int(pid), rank, float(at), float(cpu)))
    return marks


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(
    launcher: LocalLauncher, work: Path, name: str, seed: Path, args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """One job: {phase: (wall s, CPU s)} plus "total"."""
    job = work / name
    job.mkdir(parents=True)
    marks_path = job / "phases.txt"
    env = {PHASE_ENV: str(marks_path)}
    if args.device == "cuda":
        env["CONVERGENCE_RANKS_PER_GPU"] = str(args.nproc)
    request = LaunchRequest(
        name=name,
        entry=trainer_entry(job / "dump", seed, args, args.device),
        nproc=args.nproc,
        log_dir=job / "logs",
        metrics_path=job / "dump" / "metrics.jsonl",
        stop_file=job / "dump" / "STOP",
        total_steps=args.steps,
        env=env,
        wall_limit_s=600.0,
    )
    cpu0, t0 = children_cpu_s(), time.time()
    result = launcher.launch(request)
    t_end, cpu_children = time.time(), children_cpu_s() - cpu0
    if result.status != "ok":
        raise SystemExit(f"{name}: {result.status}: {result.failure}")
    marks = read_marks(marks_path)
    by: dict[str, list[tuple[int, str, float, float]]] = defaultdict(list)
    for phase, pid, rank, at, cpu in marks:
        by[phase].append((pid, rank, at, cpu))

    def first(phase: str) -> float:
        return min(at for _, _, at, _ in by[phase])

    def last(phase: str) -> float:
        return max(at for _, _, at, _ in by[phase])

    def cpu_between(a: str, b: str) -> float:  # summed over the ranks
        start = {pid: cpu for pid, _, _, cpu in by[a]}
        return sum(cpu - start[pid] for pid, _, _, cpu in by[b] if pid in start)

    records = [json.loads(x) for x in request.metrics_path.read_text().splitlines()]  # type: ignore[union-attr]
    steps = [r for r in records if "step" in r and "loss" in r]
    first_step_s = float(steps[0]["wall_s"]) if steps else 0.0
    agent_cpu = by["agent_imported"][0][3]
    # The agent's CPU at its end includes its ranks (waited for); a torchrun agent's own
    # finalization comes after its last mark, so for our direct child take the kernel's count.
    agent_total = by["agent_exit"][0][3] if by["agent_exit"] else 0.0
    total_cpu = max(agent_total, cpu_children)
    bounds = [
        t0,
        first("agent_imported"),
        first("rank_start"),
        last("rank_imported"),
        last("process_group"),
        last("steps_begin"),
        last("steps_begin") + first_step_s,
        last("steps_end"),
        t_end,
    ]
    cpus = [
        agent_cpu,
        0.0,  # filled below: the agent's rendezvous and watching (what is left of its own)
        cpu_between("rank_start", "rank_imported"),
        cpu_between("rank_imported", "process_group"),
        cpu_between("process_group", "steps_begin"),
        float("nan"),
        cpu_between("steps_begin", "steps_end"),
        cpu_between("steps_end", "exit"),
    ]
    out = {phase: (bounds[i + 1] - bounds[i], cpus[i]) for i, phase in enumerate(PHASES)}
    steps_cpu = out["other steps"][1]
    out["first step"] = (out["first step"][0], float("nan"))
    out["other steps"] = (out["other steps"][0], steps_cpu)  # all steps' CPU, first included
    accounted = sum(c for c in cpus if c == c)
    out["rendezvous"] = (out["rendezvous"][0], max(total_cpu - accounted, 0.0))
    out["total"] = (t_end - t0, total_cpu)
    return out


def fmt(values: list[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=int, default=None, help="default: 3 on CPU, 60 on GPU")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--starts", default="stock,torchrun,warm")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps is None:
        args.steps = 60 if args.device == "cuda" else 3
    starts = [s for s in args.starts.split(",") if s]
    results: dict[str, list[dict[str, tuple[float, float]]]] = {s: [] for s in starts}
    server_start: tuple[float, float] | None = None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fixed-cost-") as tmp:
        work = Path(tmp)
        seed = make_seed(work)
        launchers = {s: make_launcher(s) for s in starts}
        if "warm" in launchers:
            server_start = launchers["warm"].warm_up()
        for r in range(args.rounds):
            for start in starts:
                try:
                    res = run_one(launchers[start], work, f"{start}-{r}", seed, args)
                except SystemExit as exc:  # one way failing must not lose the others' rows
                    print(f"round {r} {start}: FAILED: {exc}")
                    continue
                results[start].append(res)
                print(
                    f"round {r} {start}: {res['total'][0]:.2f} s wall, {res['total'][1]:.2f} s CPU"
                )
        for launcher in launchers.values():
            launcher.close()
    what = (
        f"{args.nproc}-rank {args.steps}-step debug job, "
        f"{'bf16 on one GPU (ranks share it through gloo)' if args.device == 'cuda' else 'fp32 on CPU (gloo)'}"
    )
    head = "| phase | " + " | ".join(f"{s} wall s | {s} CPU s" for s in starts) + " |"
    rule = "|---|" + "---|---|" * len(starts)
    rows = [head, rule]
    for phase in (*PHASES, "total"):
        cells = []
        for s in starts:
            cells.append(fmt([res[phase][0] for res in results[s]]))
            cells.append(fmt([res[phase][1] for res in results[s]]))
        name = f"**{phase}**" if phase == "total" else phase
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    lines = [
        f"### Job fixed cost ({args.device})",
        "",
        f"`python benchmarks/job_fixed_cost.py --device {args.device} --rounds {args.rounds}`: "
        f"a {what}, {args.rounds} interleaved rounds; median (min-max) per phase. "
        f"Machine: {machine()}; 1-min load {load_before:.1f} at the start.",
        "",
        table,
    ]
    if server_start is not None:
        lines += [
            "",
            f"The warm start's server (imports the distributed stack once per session): "
            f"{server_start[0]:.2f} s wall, {server_start[1]:.2f} s CPU, paid by the first job.",
        ]
    body = "\n".join(lines)
    print(body)
    if not args.no_append:
        write_section(f"job-fixed-cost-{args.device}", body)


if __name__ == "__main__":
    main()

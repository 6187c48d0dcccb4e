"""Two library benchmarks on the built-in trainer (CPU/gloo, debug model):

1. control reuse: M tests sharing one control -> control runs executed, cold vs warm cache;
2. time to verdict on a broken pair (a planted gradient bug) with early stopping vs a full run.

    python benchmarks/control_reuse_early_stop.py [--tests 3] [--steps 60] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _report import REPO, machine, write_section

from convergence.preflight import load_checked
from convergence.run.runner import Runner, RunSettings

HOOKS = REPO / "tests" / "fixtures" / "hooks"
LAYOUTS = [
    ("fsdp2-tp2", "{ dp_shard = 2, tp = 2 }"),
    ("fsdp2-pp2", "{ dp_shard = 2, pp = 2 }"),
    ("fsdp2-cp2", "{ dp_shard = 2, cp = 2 }"),
    ("ddp2", "{ dp_replicate = 2 }"),
    ("hsdp", "{ dp_replicate = 2, dp_shard = 1 }"),
]


def experiment(folder: Path, tests: int, steps: int) -> Path:
    body = [
        f"""
        [defaults]
        train_config = "{REPO}/train_configs/debug.toml"
        steps = {steps}
        seed = 11

        [control]
        name = "fsdp2"
        parallelism = {{ dp_shard = 2 }}
    """
    ]
    for name, layout in LAYOUTS[:tests]:
        body.append(f"""
        [[test]]
        name = "{name}"
        parallelism = {layout}
        """)
    body.append("""
        [[test]]
        name = "fsdp2-bug"
        parallelism = { dp_shard = 2 }
        hook = "planted_bugs:double_ffn_grad"
    """)
    path = folder / "bench.toml"
    path.write_text(textwrap.dedent("".join(body)))
    return path


def control_runs(work: Path) -> int:
    """Control runs actually executed: run folders named control-* (cache hits make none)."""
    return len(list((work / "runs").glob("*/control-*")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HOOKS))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pairs = load_checked(experiment(folder, args.tests, args.steps), rootdir=REPO).pairs
        good = [p for p in pairs if p.name != "fsdp2-bug"]
        bug = next(p for p in pairs if p.name == "fsdp2-bug")
        rows = []
        work = folder / "work"
        for label in ("cold cache", "warm cache"):
            before = control_runs(work) if work.exists() else 0
            runner = Runner(RunSettings(work_dir=work))
            start = time.monotonic()
            outcomes = [runner.run_pair(p) for p in good]
            wall = time.monotonic() - start
            executed = control_runs(work) - before
            # folders are reused by name: count cache hits directly as well
            hits = sum(1 for o in outcomes if o.control and o.control.cached)
            rows.append(
                (label, len(good), len(good) - hits, hits, wall, all(o.passed for o in outcomes))
            )
            print(
                f"{label}: {len(good)} pairs, control runs executed {len(good) - hits} "
                f"(cache hits {hits}; new folders {executed}), {wall:.1f} s",
                flush=True,
            )
        stop_rows = []
        for early in (True, False):
            runner = Runner(RunSettings(work_dir=work, early_stop=early))
            pair = dataclasses.replace(bug, early_stop=early)
            start = time.monotonic()
            outcome = runner.run_pair(pair)
            wall = time.monotonic() - start
            test = outcome.test
            steps_run = max(test.metrics["loss"].steps) if test and "loss" in test.metrics else 0
            test_wall = test.wall_s if test else float("nan")
            failing = [v.metric for v in outcome.verdicts if v.gate and not v.passed]
            first = min(
                (
                    v.first_divergent_step
                    for v in outcome.verdicts
                    if v.gate and v.first_divergent_step
                ),
                default=None,
            )
            stop_rows.append(
                (
                    "early stop on" if early else "early stop off",
                    outcome.status,
                    steps_run,
                    test_wall,
                    wall,
                    ",".join(failing),
                    first,
                )
            )
            print(
                f"early_stop={early}: {outcome.status} after {steps_run} steps, test job "
                f"{test_wall:.1f} s, pair {wall:.1f} s, failing {failing}",
                flush=True,
            )
    lines = [
        f"## Control reuse and early stopping ({time.strftime('%Y-%m-%d')}, "
        "benchmarks/control_reuse_early_stop.py)",
        "",
        f"Machine: {machine()}. `python benchmarks/control_reuse_early_stop.py --tests "
        f"{args.tests} --steps {args.steps}`: debug model, control FSDP(2), fp32, gloo.",
        "",
        "| run | pairs | control runs executed | control cache hits | wall s | all passed |",
        "|---|---:|---:|---:|---:|---|",
        *[f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]} |" for r in rows],
        "",
        "Broken pair (test hook doubles one weight's gradient; the loss stays bit-identical "
        "under Adam, the grad norm moves by ~3e-4 relative):",
        "",
        "| mode | verdict | test steps run | test job s | pair s | failing metrics | "
        "first divergent step |",
        "|---|---|---:|---:|---:|---|---:|",
        *[
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]} | {r[6]} |"
            for r in stop_rows
        ],
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("control_reuse_early_stop", text)


if __name__ == "__main__":
    main()

"""What the anchored check (pair key ``anchor_every``) costs on a torchtitan pair: jobs, CPU
seconds and wall, each configuration a whole convergence session in a fresh work folder (no run
cache), the CPU seconds those of its whole process tree (``RUSAGE_CHILDREN``).

    pair     control: one rank; test: TP 2 (its DP degree is the control's, as torchtitan's
             dataloader needs); llama3 debug model, seq 64, local batch 2, fp32, no early stop
    rows     the paired and the twin regime, each without and with anchor_every

Jobs are counted from the session's run folders (the seed checkpoint's job is not among them).

    python benchmarks/torchtitan_anchors_cost.py [--steps 12] [--every 4]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from _report import machine  # noqa: E402

from experiments import experiment_doc, write_toml  # noqa: E402


def experiment(steps: int, every: int, regime: str) -> dict[str, object]:
    defaults: dict[str, object] = {
        "backend": "torchtitan",
        "backend_options": {"module": "llama3", "config": "llama3_debugmodel"},
        "train_config": "tt_anchor_cost.toml",
        "steps": steps,
        "seed": 42,
        "local_batch_size": 2,
        "regime": regime,
        "early_stop": False,
        "overrides": {
            "training.seq_len": 64,
            "lr_scheduler.warmup_steps": 2,
            "validator.enable": False,
        },
    }
    if every:
        defaults["anchor_every"] = every
    return experiment_doc(
        experiment={"description": "torchtitan: the anchored check's cost"},
        defaults=defaults,
        control={"name": "single", "parallelism": {"dp_shard": 1}},
        tests=[{"name": "tp2", "parallelism": {"dp_shard": 1, "tp": 2}}],
    )


def session(doc: dict[str, object]) -> tuple[float, float, int, str]:
    """(wall s, CPU s, jobs, pytest's last line) of one convergence session on ``doc``."""
    with tempfile.TemporaryDirectory(prefix="tt-anchor-cost-") as tmp:
        root = Path(tmp)
        path = write_toml(root / "experiments" / "tt_anchor_cost.toml", doc)
        (root / "pytest.ini").write_text("[pytest]\n")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-m",
                "convergence",
                "-p",
                "no:cacheprovider",
                f"--convergence-workdir={root / 'work'}",
                str(path),
            ],
            cwd=root,
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        jobs = len([p for p in (root / "work" / "runs").glob("*/*") if p.name != "probe"])
        last = (done.stdout.strip().splitlines() or [""])[-1]
    return wall, cpu, jobs, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--regimes", nargs="+", default=["paired", "twin"])
    args = parser.parse_args()
    rows = []
    for regime in args.regimes:
        for every in (0, args.every):
            wall, cpu, jobs, last = session(experiment(args.steps, every, regime))
            name = f"{regime}, " + (f"anchor_every {every}" if every else "no anchors")
            rows.append((name, jobs, cpu, wall, last))
            print(f"{name}: {jobs} jobs, {cpu:.1f} CPU s, {wall:.1f} s wall ({last})", flush=True)
    print(
        f"\nMachine: {machine()}. torchtitan llama3 debug model, fp32, {args.steps} steps, "
        "control one rank, test TP 2.\n"
    )
    print("| pair | jobs | CPU s | wall s | pytest |")
    print("|---|---:|---:|---:|---|")
    for name, jobs, cpu, wall, last in rows:
        print(f"| {name} | {jobs} | {cpu:.1f} | {wall:.1f} | {last} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

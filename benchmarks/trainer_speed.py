"""Tokens/s of the built-in trainer on the shipped debug config: one process vs each layout.

    python benchmarks/trainer_speed.py [--steps 30] [--no-write]

Every layout reads the same 16 samples (1024 tokens) per optimizer step. Tokens/s is the median
of the per-step values after the first 5 steps (warm-up), as the trainer logs them. Appends a
section to BENCHMARKS.md (other benchmarks write there too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import machine, write_section

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
WARMUP = 5

LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("single process", 1, ["--training.local_batch_size=16"]),
    ("grad accum 2", 1, ["--training.grad_accum_steps=2"]),
    ("DDP(2)", 2, ["--parallelism.dp_replicate=2"]),
    ("FSDP(2)", 2, ["--parallelism.dp_shard=2"]),
    ("FSDP(2) + CPU offload", 2, ["--parallelism.dp_shard=2", "--training.cpu_offload=true"]),
    ("FSDP(2) + AC full", 2, ["--parallelism.dp_shard=2", "--activation_checkpoint.mode=full"]),
    (
        "HSDP(2x2)",
        4,
        [
            "--parallelism.dp_replicate=2",
            "--parallelism.dp_shard=2",
            "--training.local_batch_size=4",
        ],
    ),
    ("FSDP(2)+TP(2)", 4, ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
    (
        "FSDP(2)+TP(2)+SP",
        4,
        ["--parallelism.dp_shard=2", "--parallelism.tp=2", "--parallelism.sequence_parallel=true"],
    ),
    ("FSDP(2)+PP(2) 1F1B", 4, ["--parallelism.dp_shard=2", "--parallelism.pp=2"]),
    (
        "FSDP(2)+PP(2) Interleaved1F1B",
        4,
        [
            "--parallelism.dp_shard=2",
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=Interleaved1F1B",
        ],
    ),
    ("FSDP(2)+CP(2)", 4, ["--parallelism.dp_shard=2", "--parallelism.cp=2"]),
    (
        "FSDP(2)+TP(2)+PP(2)",
        8,
        ["--parallelism.dp_shard=2", "--parallelism.tp=2", "--parallelism.pp=2"],
    ),
]


def measure(nproc: int, overrides: list[str], steps: int) -> tuple[float, float, float]:
    """(median tokens/s after warm-up, final loss, wall seconds of the whole launch)."""
    with tempfile.TemporaryDirectory() as dump:
        module = [
            "-m",
            "convergence.trainer",
            "--config",
            str(DEBUG),
            f"--metrics.dump_folder={dump}",
            f"--training.steps={steps}",
            "--metrics.val_every=0",
            "--metrics.enable_tensorboard=false",
            *overrides,
        ]
        cmd = (
            [sys.executable, *module]
            if nproc == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                *module,
            ]
        )
        start = time.perf_counter()
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(dump, "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(r["tokens_per_s"] for r in rows[WARMUP:])
    return tps, rows[-1]["loss"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for name, nproc, overrides in LAYOUTS:
        tps, loss, wall = measure(nproc, overrides, args.steps)
        rows.append((name, nproc, tps, loss, wall))
        print(
            f"{name:32s} {nproc:2d} proc  {tps:9.0f} tok/s  loss {loss:.6f}  launch {wall:5.1f} s",
            flush=True,
        )
    base = rows[0][2]
    lines = [
        f"## Trainer speed: debug.toml on CPU ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {machine()}. `python benchmarks/trainer_speed.py --steps {args.steps}`: "
        f"gloo, fp32, OMP_NUM_THREADS=1, 1024 tokens per optimizer step in every layout; "
        f"tokens/s is the median per-step value after {WARMUP} warm-up steps. With more "
        "processes than cores the layouts measure communication and oversubscription, not "
        "scaling; the point is the relative cost of each parallelism's machinery on a tiny "
        "model, and that every layout reaches the same final loss.",
        "",
        "| layout | processes | tokens/s | vs 1 process | final loss | launch wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, nproc, tps, loss, wall in rows:
        lines.append(
            f"| {name} | {nproc} | {tps:.0f} | {tps / base:.2f}x | {loss:.6f} | {wall:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section("trainer_speed", text)


if __name__ == "__main__":
    main()

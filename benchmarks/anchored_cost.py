"""What the anchored check (pair key ``anchor_every``) costs, in jobs, steps and CPU seconds.

Runs the built-in trainer directly (stock ``torch.distributed.run``, one OpenMP thread per
rank), the CPU seconds of each job being its whole process tree's (``RUSAGE_CHILDREN``):

    control            FSDP(2), N steps, no anchors (what every pair's control costs today)
    control + anchors  the same with checkpoint.anchor_every = E (a checkpoint every E steps);
                       with --confirming, also with checkpoint.confirming_anchors (the twin
                       regime's control: each anchor's next state too)
    anchored test      the test layout, one step from each anchor (checkpoint.anchored_from);
                       with --anchored-steps M, M steps from each (checkpoint.anchored_steps)
    test               the test layout's own N-step job, for scale

Per pair, the anchored check adds the anchored test job; per control group (cached, shared by
its pairs) the anchor saves and, in the twin regime, one anchored job per twin (each about an
anchored test job of the twin's layout).

    python benchmarks/anchored_cost.py --steps 500 --every 25 --precision bf16 \
        [--anchored-steps 1 8] [--confirming]
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

from _report import machine  # noqa: E402


def run(nproc: int, args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one trainer job."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "convergence.trainer",
            "--config",
            str(REPO / "train_configs" / "debug.toml"),
            "--metrics.enable_tensorboard=false",
            *args,
        ],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument(
        "--anchored-steps",
        type=int,
        nargs="+",
        default=[1],
        help="steps from each anchor (checkpoint.anchored_steps): one anchored row per value",
    )
    parser.add_argument(
        "--confirming",
        action="store_true",
        help="also the twin regime's control with confirming anchors (each anchor's next "
        "state) and the anchored test from all of them",
    )
    args = parser.parse_args()
    common = [f"--training.steps={args.steps}"]
    if args.precision == "bf16":
        common.append("--training.param_dtype=bfloat16")
    control = ["--parallelism.dp_shard=2"]
    test = ["--parallelism.dp_shard=2", "--parallelism.tp=2"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="anchored-cost-") as tmp:
        out = Path(tmp)
        jobs = [
            ("control", 2, [*common, *control, f"--metrics.dump_folder={out / 'c'}"]),
            (
                "control + anchors",
                2,
                [
                    *common,
                    *control,
                    f"--metrics.dump_folder={out / 'ca'}",
                    f"--checkpoint.anchor_every={args.every}",
                ],
            ),
            *(
                (
                    f"anchored test (fsdp2-tp2, {m} step{'s' if m > 1 else ''} from each anchor)",
                    4,
                    [
                        *common,
                        *test,
                        f"--metrics.dump_folder={out / f'a{m}'}",
                        f"--checkpoint.anchored_from={out / 'ca' / 'anchors'}",
                        f"--checkpoint.anchored_steps={m}",
                        "--metrics.val_every=0",
                    ],
                )
                for m in args.anchored_steps
            ),
            ("test (fsdp2-tp2)", 4, [*common, *test, f"--metrics.dump_folder={out / 't'}"]),
        ]
        if args.confirming:
            jobs += [
                (
                    "control + anchors + confirming anchors",
                    2,
                    [
                        *common,
                        *control,
                        f"--metrics.dump_folder={out / 'cc'}",
                        f"--checkpoint.anchor_every={args.every}",
                        "--checkpoint.confirming_anchors=true",
                    ],
                ),
                (
                    "anchored test (fsdp2-tp2, one step from each anchor and confirming anchor)",
                    4,
                    [
                        *common,
                        *test,
                        f"--metrics.dump_folder={out / 'ac'}",
                        f"--checkpoint.anchored_from={out / 'cc' / 'anchors'}",
                        "--metrics.val_every=0",
                    ],
                ),
            ]
        for name, nproc, job_args in jobs:
            wall, cpu = run(nproc, job_args)
            rows.append((name, nproc, wall, cpu))
            print(f"{name}: {wall:.1f} s wall, {cpu:.1f} CPU s", flush=True)
        anchors = out / "ca" / "anchors"
        size = sum(p.stat().st_size for p in anchors.rglob("*") if p.is_file())
        count = len(list(anchors.iterdir()))
    print(
        f"\nMachine: {machine()}. {args.precision}, debug model, {args.steps} steps, "
        f"anchor_every {args.every} ({count} anchors, {size / 2**20:.1f} MiB on disk).\n"
    )
    print("| job | ranks | wall s | CPU s |")
    print("|---|---:|---:|---:|")
    for name, nproc, wall, cpu in rows:
        print(f"| {name} | {nproc} | {wall:.1f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

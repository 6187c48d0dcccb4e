"""What ``grads_cast_e4m3`` (detection_bugs/precision.py) clips on real training gradients.

    python benchmarks/precision_saturation.py [--seeds 1000 1001 1002] [--steps 30]

The planted bug scales each backward gradient for e5m2 (57344 / amax) but casts it to e4m3fn
(largest 448), so every entry with |g| > amax / 128 saturates. tests/test_precision.py shows
that a Gaussian gradient has ~97 % of its entries there; real gradients are heavier-tailed, so
the fraction a real run loses is the question. This trains correct float8 tensorwise
(emulated) on the debug model as the pairs do (bf16 parameters, FSDP2 on 2 ranks), and
records, on rank 0, for every e5m2 cast torchao makes
(the output gradient of every converted linear, for its input-gradient and weight-gradient
matmuls), the fraction of entries above amax / 128 -- what the bug would clamp at that cast.
Nothing is changed: the recording wraps torchao's cast and returns its result. Prints a
table per seed (median, 10th and 90th percentile over the casts of steps 1, 2-10, 11-N) and
appends it to BENCHMARKS.md's "Precision techniques" section by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug.toml"
OUT_ENV = "CONVERGENCE_SATURATION_OUT"
HOOK = "precision_saturation:record_e5m2_casts"


def record_e5m2_casts(model: Any, ctx: Any) -> None:
    """A parallelism hook (runs in the trainer's process): wrap torchao's dynamic float8 cast
    and append, for each e5m2 cast, the fraction of |g| > amax / 128 to the file named by
    $CONVERGENCE_SATURATION_OUT (one JSON line per cast, in call order)."""
    import torch
    from torchao.float8 import float8_linear

    right_cast = float8_linear.hp_tensor_to_float8_dynamic
    if os.environ.get("RANK", "0") != "0":  # rank 0's casts: its shard of the batch
        return
    out = Path(os.environ[OUT_ENV]).open("a")

    def recording_cast(
        hp_tensor: torch.Tensor, float8_dtype: torch.dtype, *a: Any, **k: Any
    ) -> Any:
        if float8_dtype is torch.float8_e5m2:
            g = hp_tensor.detach().abs().float()
            amax = g.max()
            frac = (g > amax / 128).float().mean().item() if amax > 0 else 0.0
            out.write(json.dumps({"frac": frac, "numel": g.numel()}) + "\n")
            out.flush()
        return right_cast(hp_tensor, float8_dtype, *a, **k)

    float8_linear.hp_tensor_to_float8_dynamic = recording_cast


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cell(fracs: list[float], per_step: int, first: int, last: int) -> str:
    """Median (10th-90th percentile) of the casts of steps ``first``..``last``."""
    vals = fracs[(first - 1) * per_step : last * per_step]
    if not vals:
        return "-"
    return f"{100 * statistics.median(vals):.1f} % ({100 * pct(vals, 0.1):.1f}-{100 * pct(vals, 0.9):.1f} %)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1000, 1001, 1002])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks"), *filter(None, [env.get("PYTHONPATH")])]
    )
    print(
        "| seed | casts per step | step 1: median (p10-p90) | steps 2-10 | steps 11-%d |"
        % args.steps
    )
    print("|---:|---:|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="precision-saturation-") as tmp:
        for seed in args.seeds:
            record = Path(tmp) / f"casts-{seed}.jsonl"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "convergence.trainer",
                "--config",
                str(CONFIG),
                f"--training.seed={seed}",
                f"--training.steps={args.steps}",
                "--parallelism.dp_shard=2",
                "--training.param_dtype=bfloat16",
                "--precision.kernels=emulated",
                "--precision.float8=tensorwise",
                f"--parallelism.hook={HOOK}",
                f"--metrics.dump_folder={tmp}/run-{seed}",
            ]
            done = subprocess.run(
                cmd, env={**env, OUT_ENV: str(record)}, capture_output=True, text=True
            )
            if done.returncode != 0:
                print(f"seed {seed}: exit {done.returncode}\n{done.stderr[-3000:]}")
                return 1
            fracs = [json.loads(line)["frac"] for line in record.read_text().splitlines()]
            per_step = len(fracs) // args.steps
            if per_step * args.steps != len(fracs):
                print(f"seed {seed}: {len(fracs)} casts do not divide into {args.steps} steps")
                return 1

            print(
                f"| {seed} | {per_step} | {cell(fracs, per_step, 1, 1)} | {cell(fracs, per_step, 2, 10)} | {cell(fracs, per_step, 11, args.steps)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

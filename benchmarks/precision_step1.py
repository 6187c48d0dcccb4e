"""How far float8 recipes' step-1 gradients sit from bf16's, per part (docs/precision.md).

    python benchmarks/precision_step1.py [--seeds 1000 1001 1002] [--out FILE]

Step 1 of a pair is a same-state comparison: the control and the test start from one seed
checkpoint and read the same first batch, so their per-part gradient norms
(``grad_norm/<part>``) differ only by the arithmetic. For each seed: a bf16 FSDP2 control (2
ranks, the debug model, 1 step), each correct recipe (float8 tensorwise, rowwise, float8
all-gather, MXFP8, emulated) and each planted bug of detection_bugs/precision.py; prints each
job's per-part |log(norm / bf16 norm)| (max over parts, and the part) and appends a JSON line
per job to --out. Measures whether a bug changes anything at step 1, and how far correct
recipes sit from bf16 there (what a step-1 tolerance would have to allow).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug.toml"

VARIANTS: dict[str, list[str]] = {
    "bf16": [],
    "float8-tensorwise": ["--precision.float8=tensorwise"],
    "float8-rowwise": ["--precision.float8=rowwise"],
    "float8-all-gather": ["--precision.float8=tensorwise", "--precision.float8_all_gather=true"],
    "mxfp8": ["--precision.mxfp8=true"],
    "bug:grads-e4m3": [
        "--precision.float8=tensorwise",
        "--parallelism.hook=detection_bugs.precision:grads_e4m3",
    ],
    "bug:grads-cast-e4m3": [
        "--precision.float8=tensorwise",
        "--parallelism.hook=detection_bugs.precision:grads_cast_e4m3",
    ],
    "bug:local-amax": [
        "--precision.float8=tensorwise",
        "--parallelism.hook=detection_bugs.precision:local_amax_scale",
    ],
    "bug:inverted-weight-scale": [
        "--precision.float8=tensorwise",
        "--parallelism.hook=detection_bugs.precision:inverted_weight_scale",
    ],
}


def trainer(*args: str) -> list[str]:
    return [sys.executable, "-m", "convergence.trainer", "--config", str(CONFIG), *args]


def step_one(path: Path) -> dict[str, float]:
    with path.open() as f:
        row = json.loads(f.readline())
    return {k: float(v) for k, v in row.items() if k.startswith("grad_norm") or k == "loss"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1000, 1001, 1002])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("precision_step1.jsonl"))
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks" / "detection"), *filter(None, [env.get("PYTHONPATH")])]
    )
    with tempfile.TemporaryDirectory(prefix="precision-step1-") as tmp:
        root = Path(tmp)
        for seed in args.seeds:
            seed_dir = root / f"seed{seed}"
            common = [f"--training.seed={seed}", f"--checkpoint.seed_checkpoint={seed_dir}"]
            subprocess.run(
                trainer(
                    *common,
                    "--checkpoint.create_seed_checkpoint=true",
                    f"--metrics.dump_folder={seed_dir}/creator",
                ),
                env=env,
                check=True,
                capture_output=True,
            )
            norms: dict[str, dict[str, float]] = {}
            for name in args.variants:
                dump = root / f"{name.replace(':', '_')}-{seed}"
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    "2",
                    "-m",
                    "convergence.trainer",
                    "--config",
                    str(CONFIG),
                    *common,
                    "--training.steps=1",
                    "--parallelism.dp_shard=2",
                    "--training.param_dtype=bfloat16",
                    "--precision.kernels=emulated",
                    *VARIANTS[name],
                    f"--metrics.dump_folder={dump}",
                ]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{name} seed {seed}: exit {done.returncode}\n{done.stderr[-2000:]}")
                    continue
                norms[name] = step_one(dump / "metrics.jsonl")
                base = norms.get("bf16")
                ratios = {}
                if base is not None and name != "bf16":
                    ratios = {
                        k: math.log(norms[name][k] / base[k])
                        if base[k] > 0 and norms[name][k] > 0
                        else math.inf
                        for k in base
                        if k.startswith("grad_norm/")
                    }
                worst = max(ratios, key=lambda k: abs(ratios[k]), default=None)
                line = {
                    "seed": seed,
                    "variant": name,
                    "step1": norms[name],
                    "log_ratio_vs_bf16": ratios,
                }
                with args.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")
                if worst is not None:
                    print(
                        f"{name:28s} seed {seed}: max |log ratio| {abs(ratios[worst]):.4f} "
                        f"({worst}); loss {norms[name]['loss']:.5f} vs {base['loss']:.5f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

"""torchtitan pairs written with no ``compare`` table, at several seeds: does each layout pass on
the default tolerances, and how close does each metric come to its tolerance?

Runs torchtitan 0.3.0 for real on CPU (gloo) through the plugin (one pytest session per seed),
then reads each pair's saved outcome: per layout and metric, the worst share of the tolerance
over the steps (``details.max_ratio`` of the paired verdict) and over the seeds.

    python benchmarks/torchtitan_defaults.py [--seeds 1 2 3] [--steps 6] [--no-cp] [--only cp]
        [--no-write]

Layouts (the debug model, seq 64, local batch 2): FSDP2 on 2 ranks vs FSDP2+TP2, FSDP2+TP2+SP,
FSDP2+PP2 (1F1B), FSDP2+PP2 (Interleaved1F1B); FSDP2 on 4 ranks vs HSDP 2x2 (the same four
data-parallel ranks: torchtitan gives each its own contiguous chunk of the data); FSDP2 on 2
ranks vs FSDP2+CP2 at seq 256 (flex attention's CP block mask needs seq divisible by cp x 128).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import machine, write_section

METRICS = ("loss", "grad_norm", "grad_norm_parts", "lr", "data_fingerprint")

COMMON = """\
[defaults]
backend = "torchtitan"
train_config = "{name}.toml"
backend_options = {{ module = "llama3", config = "llama3_debugmodel" }}
steps = {steps}
seed = {seed}
local_batch_size = 2
early_stop = false
overrides = {{ "training.seq_len" = {seq}, "lr_scheduler.warmup_steps" = 2, \
"validator.enable" = false }}
"""

EXPERIMENTS = {
    "tp_pp": (
        64,
        """
[control]
name = "fsdp2"
parallelism = { dp_shard = 2 }

[[test]]
name = "fsdp2-tp2"
parallelism = { dp_shard = 2, tp = 2 }

[[test]]
name = "fsdp2-tp2-sp"
parallelism = { dp_shard = 2, tp = 2, sequence_parallel = true }

[[test]]
name = "fsdp2-pp2-1F1B"
parallelism = { dp_shard = 2, pp = 2, pp_schedule = "1F1B" }

[[test]]
name = "fsdp2-pp2-Interleaved1F1B"
parallelism = { dp_shard = 2, pp = 2, pp_schedule = "Interleaved1F1B", pp_microbatches = 2 }
""",
    ),
    "hsdp": (
        64,
        """
[control]
name = "fsdp4"
parallelism = { dp_shard = 4 }

[[test]]
name = "hsdp2x2"
parallelism = { dp_replicate = 2, dp_shard = 2 }
""",
    ),
    "cp": (
        256,
        """
[control]
name = "fsdp2"
parallelism = { dp_shard = 2 }

[[test]]
name = "fsdp2-cp2"
parallelism = { dp_shard = 2, cp = 2 }
""",
    ),
}


def write_experiments(
    folder: Path, *, seed: int, steps: int, cp: bool, only: list[str] | None = None
) -> list[Path]:
    files = []
    for name, (seq, body) in EXPERIMENTS.items():
        if (name == "cp" and not cp) or (only and name not in only):
            continue
        path = folder / f"{name}.toml"
        head = f'[experiment]\ndescription = "torchtitan defaults: {name}"\n\n'
        path.write_text(head + COMMON.format(name=name, steps=steps, seed=seed, seq=seq) + body)
        files.append(path)
    return files


def run_seed(
    work: Path, seed: int, steps: int, cp: bool, only: list[str] | None = None
) -> tuple[list[dict], float]:
    folder = work / f"seed{seed}"
    folder.mkdir(parents=True)
    files = write_experiments(folder, seed=seed, steps=steps, cp=cp, only=only)
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "convergence",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--convergence-workdir={folder / 'work'}",
            *map(str, files),
        ],
        cwd=folder,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    wall = time.monotonic() - started
    outcomes = [json.loads(p.read_text()) for p in folder.glob("work/sessions/*/*.outcome.json")]
    return outcomes, wall


def share(outcome: dict, metric: str) -> float | None:
    for verdict in outcome["verdicts"]:
        if verdict["metric"] == metric and not verdict.get("not_compared"):
            if verdict["method"] == "exact":
                return 0.0 if verdict["passed"] else float("inf")
            ratio = verdict.get("details", {}).get("max_ratio")
            return None if ratio is None else float(ratio)
    return None


def table(by_seed: dict[int, list[dict]]) -> str:
    rows: dict[str, dict[str, list[float]]] = {}
    verdicts: dict[str, list[str]] = {}
    for outcomes in by_seed.values():
        for outcome in outcomes:
            test = outcome["pair"]["test"]["name"]
            verdicts.setdefault(test, []).append(outcome["status"])
            for metric in METRICS:
                value = share(outcome, metric)
                if value is not None:
                    rows.setdefault(test, {}).setdefault(metric, []).append(value)
    head = "| test layout | verdicts | " + " | ".join(METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 2)]
    for test in sorted(verdicts):
        cells = []
        for metric in METRICS:
            values = rows.get(test, {}).get(metric)
            cells.append(f"{max(values):.3f}" if values else "-")
        status = ", ".join(verdicts[test])
        lines.append(f"| {test} | {status} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-cp", action="store_true", help="skip the CP pair (4x the cost)")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(EXPERIMENTS), help="these experiments alone"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    by_seed, walls = {}, []
    with tempfile.TemporaryDirectory(prefix="tt-defaults-") as tmp:
        for seed in args.seeds:
            by_seed[seed], wall = run_seed(Path(tmp), seed, args.steps, not args.no_cp, args.only)
            walls.append(wall)
    body = (
        f"torchtitan 0.3.0, no `compare` table, {args.steps} steps, seeds "
        f"{', '.join(map(str, args.seeds))} ({sum(walls) / 60:.0f} min); each metric's worst "
        "share of its tolerance over the steps and seeds (data_fingerprint: exact, 0 = equal)."
        f"\n\n{table(by_seed)}\n\nMachine: {machine()}.\n"
        "`python benchmarks/torchtitan_defaults.py`"
    )
    print(body)
    if not args.no_write:
        write_section(
            "torchtitan-defaults", "## torchtitan pairs on the default tolerances\n\n" + body
        )


if __name__ == "__main__":
    main()

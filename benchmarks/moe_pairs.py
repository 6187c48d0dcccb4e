"""Correct MoE pairs (train_configs/moe_debug.toml) and what routing flips do to them.

    python benchmarks/moe_pairs.py --steps 100 --seeds 1 2 3 [--precision bf16] [--tests ep2 ...]

For each seed: the FSDP control against each test layout, with the default verdict of the
pair's regime (fp32: paired; bf16: twin). Besides the verdict, per pair: on how many steps the
routing fingerprint (tokens per expert per layer, moe.StepRouting) differs from the control's,
the first such step, and the largest difference of one expert's token count -- a routing flip
is a top-k decision that the test's rounding decided the other way. One JSON line per pair to
--out, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from _report import machine, record_line  # noqa: E402

from convergence.preflight import load_checked  # noqa: E402
from convergence.run.outcome import PairOutcome, SideOutcome  # noqa: E402
from convergence.run.runner import Runner, RunSettings  # noqa: E402
from experiments import write_experiment  # noqa: E402

LAYOUTS: dict[str, dict[str, Any]] = {
    "ep2": {"dp_shard": 2, "ep": 2},
    # TP without EP: what TP's own rounding does to the routing model (beside tp2-ep2).
    "tp2": {"dp_shard": 2, "tp": 2},
    "tp2-ep2": {"dp_shard": 2, "tp": 2, "ep": 2},
    "pp2-ep2": {"dp_shard": 2, "pp": 2, "ep": 2},
    "fsdp4-ep2": {"dp_shard": 4, "ep": 2},
    "fsdp4-ep4": {"dp_shard": 4, "ep": 4},
    "cp2-ep2": {"dp_shard": 2, "cp": 2, "ep": 2},
}
# What a layout needs on both sides of its pair: CP splits sequences, and the sequence-wise
# balance loss needs whole ones (refused at collection: convergence/trainer/moe_rules.py), so a
# CP pair runs without it -- the control too, or the two would train different objectives.
NEEDS: dict[str, dict[str, Any]] = {"cp2-ep2": {"model.aux_loss_coeff": 0.0}}
CONTROLS = {2: {"dp_shard": 2}, 4: {"dp_shard": 4}}


def _lines(side: SideOutcome | None) -> list[dict[str, Any]]:
    assert side is not None and side.run_dir is not None
    (path,) = side.run_dir.rglob("metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def routing_flips(outcome: PairOutcome) -> dict[str, Any]:
    control = {r["step"]: r for r in _lines(outcome.control)}
    test = {r["step"]: r for r in _lines(outcome.test)}
    steps = sorted(set(control) & set(test))
    differ = [
        s for s in steps if control[s]["routing_fingerprint"] != test[s]["routing_fingerprint"]
    ]
    keys = [k for k in control[steps[0]] if k.startswith("moe_tokens/")]
    worst = max((abs(control[s][k] - test[s][k]) for s in steps for k in keys), default=0)
    return {
        "steps_compared": len(steps),
        "routing_steps_differ": len(differ),
        "routing_first_differs": differ[0] if differ else None,
        "max_tokens_moved": worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tests", nargs="+", default=["ep2"], choices=sorted(LAYOUTS))
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", type=Path, default=Path("moe_pairs.jsonl"))
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="work folder (default: a new temporary one); an earlier run's folder reuses "
        "its cached control jobs, so more layouts of the same seeds cost only their tests",
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="the test side's training.forward_noise (2**-24 = fp32 unit roundoff): a "
        "rounding-level change of its forward at every step, to provoke routing flips",
    )
    parser.add_argument(
        "--flip-at",
        type=int,
        default=0,
        help="step at which the test side decides its nearest top-k tie the other way "
        "(tests/fixtures/hooks/moe_flip.py): one legitimate routing flip",
    )
    parser.add_argument(
        "--hook",
        default="",
        help="a planted bug on the test side, e.g. detection_bugs.late_onset:"
        "moe_router_grad_not_reduced_from_50 (benchmarks/detection/ on the jobs' path)",
    )
    args = parser.parse_args()
    if args.hook:
        detection = str(HERE / "detection")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (detection, os.environ.get("PYTHONPATH", "")) if p
        )
        sys.path.insert(0, detection)
    if args.flip_at:
        hooks = str(HERE.parent / "tests" / "fixtures" / "hooks")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (hooks, os.environ.get("PYTHONPATH", "")) if p
        )
        sys.path.insert(0, hooks)
    work = args.work or Path(tempfile.mkdtemp(prefix="moe_pairs_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder (--work to reuse its cached controls): {work}", flush=True)
    runner = Runner(RunSettings(work_dir=work / "work", idle_limit_s=600, wall_limit_s=3600))
    techniques = {"param_dtype": "bfloat16"} if args.precision == "bf16" else {}
    rows = []
    # Layout-major: cut short, the file holds every seed of the first layouts rather than the
    # first seeds of all (a control job is cached, so layouts sharing one pay for it once).
    for name in args.tests:
        for seed in args.seeds:
            test = LAYOUTS[name]
            control = CONTROLS[test["dp_shard"]]
            # A planted bug is a test of its own name, so its pair folder and experiment file
            # sit beside the correct layout's (sharing its cached controls).
            planted = args.hook.rpartition(":")[2].replace("_", "-")
            tname = f"{name}-{planted}" if planted else name
            path = write_experiment(
                work,
                file=f"moe_{seed}_{tname}.toml",
                defaults={
                    "train_config": "moe_debug",
                    "steps": args.steps,
                    "seed": seed,
                    "probe": "off",
                    **({"overrides": NEEDS[name]} if name in NEEDS else {}),
                },
                control={
                    "name": f"fsdp{control['dp_shard']}",
                    "parallelism": control,
                    "techniques": techniques,
                },
                tests=[
                    {
                        "name": tname,
                        "parallelism": test,
                        "techniques": techniques,
                        **(
                            {"overrides": {"training.forward_noise": args.noise}}
                            if args.noise
                            else {}
                        ),
                        **(
                            {"hook": f"moe_flip:nearest_tie_at_{args.flip_at}"}
                            if args.flip_at
                            else {}
                        ),
                        **({"hook": args.hook} if args.hook else {}),
                    }
                ],
            )
            (pair,) = load_checked(path, rootdir=HERE.parent).pairs
            outcome = runner.run_pair(pair)
            # The step closest to its limit: the verdict's max |diff| / tolerance ratio.
            shares = {
                v.metric: v.details.get("max_ratio")
                for v in outcome.verdicts
                if v.gate and v.method in ("paired", "twin")
            }
            line = {
                "pair": name
                + (f"+{args.hook.rpartition(':')[2]}" if args.hook else "")
                + (f"+noise{args.noise:.2g}" if args.noise else "")
                + (f"+flip@{args.flip_at}" if args.flip_at else ""),
                "seed": seed,
                "precision": args.precision,
                "regime": pair.regime,
                "status": outcome.status,
                "failed": [v.metric for v in outcome.verdicts if v.gate and not v.passed],
                "worst_share": shares,
                **routing_flips(outcome),
            }
            record_line(args.out, line)
            rows.append(line)
    print(f"\nmachine: {machine()}\n")
    print(
        "| pair | precision | seed | regime | status | worst share of tolerance | "
        "routing steps differing | first | max tokens moved |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        worst = max((v for v in r["worst_share"].values() if v is not None), default=0.0)
        which = max(r["worst_share"], key=lambda k: r["worst_share"][k] or 0.0, default="-")
        print(
            f"| {r['pair']} | {r['precision']} | {r['seed']} | {r['regime']} | {r['status']} "
            f"| {worst:.2f} ({which}) | {r['routing_steps_differ']}/{r['steps_compared']} "
            f"| {r['routing_first_differs'] or '-'} | {r['max_tokens_moved']} |"
        )


if __name__ == "__main__":
    main()

"""False alarms and power of the margin regime on the built-in trainer (docs/precision.md).

    python benchmarks/precision_acceptance.py [--seeds 42 142 242] [--steps 40]
        [--bugs-only | --correct-only | --only NAME ...]

One pytest session over one experiment per base seed: a bf16 FSDP2 control (2 ranks, the
debug model) against each correct recipe -- float8 tensorwise, rowwise, float8 all-gather,
MXFP8, all emulated on CPU -- and the planted bugs of detection_bugs/precision.py (local
amax, e4m3 gradients, e5m2-scaled gradients cast to e4m3, stale all-gather scales, the
weight's scale inverted). Defaults of the margin regime
(K = 3 replicate pairs at seeds s, s+1, s+2; margin 2 control seed std's; alpha 0.05; 4
windows). A correct recipe that fails is a false alarm; a bug that does not fail is a miss.
Prints one JSON line per pair (and appends it to --out) and a table for BENCHMARKS.md.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _report import record_line  # noqa: E402

from experiments import builtin_pair  # noqa: E402

CORRECT = {
    "float8-tensorwise": {"float8": "tensorwise"},
    "float8-rowwise": {"float8": "rowwise"},
    "float8-all-gather": {"float8": "tensorwise", "float8_all_gather": True},
    "mxfp8": {"mxfp8": True},
}
BUGS = {
    "float8-local-amax": ({"float8": "tensorwise"}, "detection_bugs.precision:local_amax_scale"),
    "float8-grads-e4m3": ({"float8": "tensorwise"}, "detection_bugs.precision:grads_e4m3"),
    "float8-grads-cast-e4m3": (
        {"float8": "tensorwise"},
        "detection_bugs.precision:grads_cast_e4m3",
    ),
    "float8-stale-scales": (
        {"float8": "tensorwise", "float8_all_gather": True},
        "detection_bugs.precision:stale_scales",
    ),
    "float8-inverted-weight-scale": (
        {"float8": "tensorwise"},
        "detection_bugs.precision:inverted_weight_scale",
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 142, 242])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("precision_acceptance.jsonl"))
    parser.add_argument("--bugs-only", action="store_true", help="only the planted bugs")
    parser.add_argument("--correct-only", action="store_true", help="only the correct recipes")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="only these recipes and bugs (by name)"
    )
    args = parser.parse_args()
    correct = {} if args.bugs_only else CORRECT
    bugs = {} if args.correct_only else BUGS
    if args.only:
        unknown = set(args.only) - set(CORRECT) - set(BUGS)
        if unknown:
            parser.error(f"unknown names {sorted(unknown)}: choose from {[*CORRECT, *BUGS]}")
        correct = {n: t for n, t in correct.items() if n in args.only}
        bugs = {n: b for n, b in bugs.items() if n in args.only}
    with tempfile.TemporaryDirectory(prefix="precision-acceptance-") as tmp:
        root = Path(tmp)
        for seed in args.seeds:
            tests = [{"name": f"{n}-s{seed}", "techniques": t} for n, t in correct.items()]
            tests += [
                {"name": f"{n}-s{seed}", "techniques": t, "hook": hook}
                for n, (t, hook) in bugs.items()
            ]
            builtin_pair(
                root / "experiments",
                file=f"seed{seed}.toml",
                train_config="debug",
                steps=args.steps,
                seed=seed,
                parallelism={"dp_shard": 2},
                techniques={"param_dtype": "bfloat16"},
                control={"name": f"bf16-s{seed}"},
                tests=tests,
            )
        (root / "pytest.ini").write_text("[pytest]\n")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "benchmarks" / "detection"), *filter(None, [env.get("PYTHONPATH")])]
        )
        started = time.monotonic()
        cpu = os.times()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
            + ["experiments", "-m", "convergence", "--convergence-report", "report"],
            cwd=root,
            env=env,
            check=False,
        )
        wall = time.monotonic() - started
        after = os.times()
        report = json.loads((root / "report" / "report.json").read_text())
        jobs = sum(1 for _ in (root / ".convergence" / "cache").rglob("metrics.jsonl"))
        jobs += sum(1 for _ in (root / ".convergence" / "runs").rglob("metrics.jsonl"))
    rows = []
    for pair in report["pairs"]:
        name, _, seed = pair["name"].rpartition("-s")
        loss = next(v for v in pair["verdicts"] if v["metric"] == "loss")
        failing = [v["metric"] for v in pair["verdicts"] if v["gate"] and not v["passed"]]
        windows = loss["message"]
        line = {
            "recipe": name,
            "seed": int(seed),
            "planted_bug": name in BUGS,
            "status": pair["status"],
            "not_passed": failing,
            "loss_excludable": (loss.get("evidence") or {}).get("excludable"),
            "loss_margin": (loss.get("evidence") or {}).get("margin"),
            "loss_message": windows,
        }
        record_line(args.out, line)
        rows.append(line)
    print(f"\n{jobs} jobs, wall {wall:.0f} s, CPU {after.children_user - cpu.children_user:.0f} s")
    print("| recipe | seed | status | gating metrics not passed | loss: excludable / margin |")
    print("|---|---:|---|---|---|")
    for r in rows:
        excl, margin = r["loss_excludable"], r["loss_margin"]
        ratio = f"{excl:.2g} / {margin:.2g}" if excl is not None and margin else "-"
        print(
            f"| {r['recipe']}{' (bug)' if r['planted_bug'] else ''} | {r['seed']} | "
            f"{r['status']} | {', '.join(r['not_passed']) or '-'} | {ratio} |"
        )


if __name__ == "__main__":
    main()

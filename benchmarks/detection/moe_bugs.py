"""The planted MoE / expert-parallel bugs (catalogue.MOE_BUGS, detection_bugs/moe.py), measured
with the default verdict on train_configs/moe_debug.toml: FSDP2 control vs FSDP2 + EP2 with
the bug, fp32 (paired regime) and bf16 params (twin regime), default settings (early stop on).

    python benchmarks/detection/moe_bugs.py                 # all 12 (~15 min on 2 shared cores)
    python benchmarks/detection/moe_bugs.py --only moe-combine-unweighted --steps 10

Prints one line per case, then the Markdown table (bug, layout, precision, failing metric, first
divergent step).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # catalogue, pairs, run

from catalogue import MOE_BUGS, MOE_STEPS
from pairs import REPO
from run import Row, run_cases

MOE_CONFIG = REPO / "train_configs" / "moe_debug.toml"


def table(rows: list[Row], steps: int) -> str:
    out = [
        "| planted bug | layout | precision (regime) | caught | failing metrics | "
        "first divergent step | stopped at step | what it is |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        o = r.outcome
        caught = "yes" if r.caught else f"**no** ({o.status})"
        expected_ok = all(m in r.failing for m in r.case.expect)
        out.append(
            f"| {r.case.name} | {o.pair.test.layout.short_name()} | "
            f"{r.case.precision} ({o.pair.regime}) | {caught} | "
            f"{', '.join(r.failing) or '-'}{'' if expected_ok else ' (expected ' + ', '.join(r.case.expect) + ')'} | "
            f"{r.first_step or '-'} | {o.stopped_early_at or f'ran {steps}'} | {r.case.note} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=MOE_STEPS)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    cases = [c for c in MOE_BUGS if not args.only or c.name in args.only]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moe-bugs-") as tmp:
        rows = run_cases(
            cases, steps=args.steps, early_stop=True, work=Path(tmp), config=MOE_CONFIG
        )
    print()
    print(table(rows, args.steps))
    caught = sum(r.caught for r in rows)
    print(f"\n{caught}/{len(rows)} caught; whole run {(time.monotonic() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()

"""The anchored check (pair key ``anchor_every``, issue 41), measured: late-onset bugs and
correct long curves, with anchors on.

Each pair runs through the library's Runner with the default rules and early stopping, like
benchmarks/detection/run.py, plus ``anchor_every = N``: the control saves its state every N
steps and the test layout trains one step from each (convergence/checks/anchored.py). Prints one
line per pair as it finishes and appends it to ``--out`` (JSON lines: partial results survive
a long run), then a table.

    python benchmarks/detection/anchored.py --steps 500 --start 300 --anchor-every 25 \\
        --precision bf16 --cases bugs --out /tmp/anchored.jsonl
    python benchmarks/detection/anchored.py --steps 500 --anchor-every 25 --precision bf16 \\
        --cases fsdp2-tp2 fsdp2-cp2 hsdp2x2 fsdp2-pp2-1f1b --train-config CONFIG

    python benchmarks/detection/anchored.py --table /tmp/anchored.jsonl ...   # a table

Cost per pair is reported as the anchored job's wall and CPU-less wall time (the job tier
records wall time only) and its number of steps; the control's anchor saves are in the
control's own (cached) run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # catalogue, pairs
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _report

from _report import machine, record_line
from catalogue import ALL, Case, late_onset
from pairs import DEBUG_CONFIG, build_pairs

from convergence.metrics.curve import RunMetrics
from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner, RunSettings


def as_bf16(case: Case) -> Case:
    return dataclasses.replace(
        case, precision="bf16", techniques={**case.techniques, "param_dtype": "bfloat16"}
    )


def row(case: Case, outcome: PairOutcome, wall_s: float, config: Path) -> dict[str, object]:
    main = [
        v.metric for v in outcome.verdicts if v.gate and not v.passed and v.metric != "anchored"
    ]
    firsts = [
        v.first_divergent_step
        for v in outcome.verdicts
        if v.gate and not v.passed and v.metric != "anchored" and v.first_divergent_step
    ]
    anchored = outcome.verdict("anchored")
    side = next((x for x in outcome.extra_sides if x.job.name.endswith("-anchored")), None)
    return {
        "case": case.name,
        "kind": case.kind,
        "config": config.stem,
        "layout": outcome.pair.test.layout.short_name(),
        "status": outcome.status,
        "error": outcome.error,
        "main_failing": main,
        "main_first": min(firsts) if firsts else None,
        "stopped_at": outcome.stopped_early_at,
        "anchored_passed": None if anchored is None else anchored.passed,
        "anchor_step": None if anchored is None else anchored.details.get("anchor_step"),
        "anchored_message": None if anchored is None else anchored.message,
        "anchored_ratios": None
        if anchored is None
        else anchored.details.get("max_ratio_by_metric"),
        "anchored_steps": None if anchored is None else anchored.steps_compared,
        "anchored_job_s": None if side is None else round(side.wall_s, 1),
        "test_job_s": None if outcome.test is None else round(outcome.test.wall_s, 1),
        "pair_s": round(wall_s, 1),
        "localisation": {
            k: v for k, v in (outcome.localisation or {}).items() if not isinstance(v, list)
        },
    }


def table(paths: list[Path]) -> str:
    """The JSON lines of earlier runs as one markdown table."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line]
    out = [
        "| config | precision | pair | kind | start | verdict | default rules: failing (first "
        "step) | anchored: first failing anchor | anchored worst ratio (loss / grad_norm / "
        "grad_norm_parts) | anchored job s | test job s |",
        "|---|---|---|---|---:|---|---|---:|---|---:|---:|",
    ]
    for r in rows:
        ratios = r.get("anchored_ratios") or {}
        worst = " / ".join(
            f"{ratios[m]:.2g}" if m in ratios else "-"
            for m in ("loss", "grad_norm", "grad_norm_parts")
        )
        main = ", ".join(r["main_failing"]) or "pass"
        if r["main_first"]:
            main += f" ({r['main_first']})"
        verdict = r["status"] if not r.get("error") else f"{r['status']}: {r['error'][:80]}"
        anchor = (
            r["anchor_step"]
            if r["anchor_step"] is not None
            else ("pass" if r["anchored_passed"] else "-")
        )
        out.append(
            f"| {r['config']} | {r['precision']} | {r['case']} | {r['kind']} | "
            f"{r['start'] or '-'} | {verdict} | {main} | {anchor} | {worst} | "
            f"{r['anchored_job_s']} | {r['test_job_s']} |"
        )
    return "\n".join(out)


def rejudge(work: Path) -> list[dict[str, object]]:
    """The anchored verdict of every pair of an earlier run's work folder, recomputed from
    its saved curves under today's code (no training): the default rules of the twin regime
    (paired when no twin ran), the control, the twins' and the test's anchored steps."""
    from convergence.metrics.jsonl import read_jsonl as read_scalars
    from convergence.metrics.jsonl import read_part_norms
    from convergence.regimes import REGISTRY
    from convergence.stats.anchored import anchored_verdict

    runs = work / "work" / "runs"

    def read_jsonl(path: Path) -> RunMetrics:
        return {**read_scalars(path), **read_part_norms(path)}

    control = read_jsonl(
        next(p for p in runs.glob("*/control-*/dump/metrics.jsonl") if "twin" not in str(p))
    )
    twins = [read_jsonl(p) for p in runs.glob("*/control-*-anchored-*/dump/metrics.jsonl")]
    rules = REGISTRY.default_rules("twin" if twins else "paired")
    out = []
    for path in sorted(runs.glob("*/test-*-anchored-*/dump/metrics.jsonl")):
        verdict = anchored_verdict(
            rules, [control], read_jsonl(path), every=25, anchored_twins=twins
        )
        out.append(
            {
                "pair": path.parts[-4].split("toml_")[-1],
                "passed": verdict.passed,
                "anchor_step": verdict.details.get("anchor_step"),
                "anchors_failing": verdict.details.get("anchors_failing"),
                "ratios": verdict.details.get("max_ratio_by_metric"),
                "message": verdict.message,
            }
        )
    return out


def main() -> int:
    if sys.argv[1:2] == ["--rejudge"]:
        for line in rejudge(Path(sys.argv[2])):
            print(json.dumps(line))
        return 0
    if sys.argv[1:2] == ["--table"]:
        print(table([Path(p) for p in sys.argv[2:]]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--start", type=int, default=300, help="late-onset bugs: first step")
    parser.add_argument("--anchor-every", type=int, default=25)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument(
        "--cases", nargs="+", default=["bugs"], help='"bugs" (the late-onset ones) or case names'
    )
    parser.add_argument("--train-config", type=Path, default=DEBUG_CONFIG)
    parser.add_argument("--no-early-stop", action="store_true")
    parser.add_argument("--probe", action="store_true", help="localise failures (probe jobs)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per pair")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    args = parser.parse_args()

    pool = {c.name: c for c in (*ALL, *late_onset(args.start))}
    cases = [
        c
        for name in args.cases
        for c in (late_onset(args.start) if name == "bugs" else [pool[name]])
    ]
    if args.precision == "bf16":
        cases = [as_bf16(c) for c in cases]
    with tempfile.TemporaryDirectory(prefix="anchored-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        pairs = build_pairs(
            cases,
            work,
            steps=args.steps,
            config=args.train_config.resolve(),
            anchor_every=args.anchor_every,
        )
        if args.probe:
            pairs = {k: dataclasses.replace(p, probe_on_failure=True) for k, p in pairs.items()}
        runner = Runner(
            RunSettings(
                work_dir=work / "work",
                early_stop=not args.no_early_stop,
                idle_limit_s=900,
                wall_limit_s=7200,
            )
        )
        for case in cases:
            start = time.monotonic()
            outcome = runner.run_pair(pairs[case.name])
            line = row(case, outcome, time.monotonic() - start, args.train_config)
            line.update(
                precision=args.precision,
                steps=args.steps,
                start=args.start if case.kind == "bug" else None,
                anchor_every=args.anchor_every,
                machine=machine(),
                at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            )
            record_line(args.out, line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

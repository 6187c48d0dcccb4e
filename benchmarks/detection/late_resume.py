"""A resume onto a broken layout late in a run (issue 41), measured.

The catalogue's ``late_resume`` cases (catalogue.py): FSDP2 up to step K, a checkpoint, then
FSDP2+CP2 with the CP rotary offset dropped, or FSDP2+TP2 with a row-wise all-reduce left out;
beside them the same resumes onto the correct layouts. Each pair runs through the library's
Runner with the default rules and early stopping (like run.py); the table gives the pair's
verdict, the default rules' first failing step and the ``resumed`` verdict's (the twin regime's
twins resumed from the test's checkpoint, stats/resumed.py). One JSON line per pair is
appended to ``--out`` as it finishes (a long run keeps its partial results).

    python benchmarks/detection/late_resume.py --steps 500 --at 400 --precision bf16 \\
        --out /tmp/late_resume.jsonl
    python benchmarks/detection/late_resume.py --table /tmp/late_resume.jsonl
    python benchmarks/detection/late_resume.py --rejudge WORK --at 400   # saved curves, today's code
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
from catalogue import Case, late_resume
from pairs import DEBUG_CONFIG, build_pairs

from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner, RunSettings
from convergence.stats.resumed import RESUMED


def as_bf16(case: Case) -> Case:
    """bf16 parameters on the test side (its resume keeps the side's techniques)."""
    return dataclasses.replace(
        case, precision="bf16", techniques={**case.techniques, "param_dtype": "bfloat16"}
    )


def row(case: Case, outcome: PairOutcome, wall_s: float) -> dict[str, object]:
    gating = [v for v in outcome.verdicts if v.gate and not v.passed]
    main = [v for v in gating if v.metric != RESUMED]
    firsts = [v.first_divergent_step for v in main if v.first_divergent_step is not None]
    resumed = outcome.verdict(RESUMED)
    test = outcome.test
    return {
        "case": case.name,
        "kind": case.kind,
        "status": outcome.status,
        "error": outcome.error,
        "main_failing": [v.metric for v in main],
        "main_first": min(firsts) if firsts else None,
        "stopped_at": outcome.stopped_early_at,
        "resumed_passed": None if resumed is None else resumed.passed,
        "resumed_first": None if resumed is None else resumed.first_divergent_step,
        "resumed_ratios": None if resumed is None else resumed.details.get("max_ratio_by_metric"),
        "resumed_message": None if resumed is None else resumed.message,
        "test_job_s": None if test is None else round(test.wall_s, 1),
        "pair_s": round(wall_s, 1),
    }


def table(paths: list[Path]) -> str:
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line]
    out = [
        "| precision | pair | kind | verdict | default rules: failing (first step) | resumed: "
        "first failing step (steps after the resume) | resumed worst ratio (loss / grad_norm "
        "/ grad_norm_parts) | pair s |",
        "|---|---|---|---|---|---|---|---:|",
    ]
    for r in rows:
        main = ", ".join(r["main_failing"]) or "pass"
        if r["main_first"]:
            main += f" ({r['main_first']})"
        if r["resumed_passed"] is None:
            resumed = "- (no twins: paired regime)"
        elif r["resumed_passed"]:
            resumed = "pass"
        else:
            resumed = f"{r['resumed_first']} (+{r['resumed_first'] - r['at']})"
        ratios = r.get("resumed_ratios") or {}
        worst = " / ".join(
            f"{ratios[m]:.2g}" if m in ratios else "-"
            for m in ("loss", "grad_norm", "grad_norm_parts")
        )
        verdict = r["status"] if not r.get("error") else f"{r['status']}: {r['error'][:80]}"
        out.append(
            f"| {r['precision']} | {r['case']} | {r['kind']} | {verdict} | {main} | {resumed} "
            f"| {worst} | {r['pair_s']} |"
        )
    return "\n".join(out)


def rejudge(work: Path, at: int) -> list[dict[str, object]]:
    """The ``resumed`` verdict of every pair of an earlier run's work folder, recomputed from
    its saved curves under today's code (no training): the control, the test's two jobs and
    the twins resumed from its checkpoint; twin rules where twins resumed."""
    from convergence.metrics.jsonl import read_jsonl
    from convergence.regimes import REGISTRY
    from convergence.run.resume import joined
    from convergence.stats.registry import compare_all
    from convergence.stats.resumed import resumed_verdict

    runs = work / "work" / "runs"
    metrics = "dump/metrics.jsonl"
    control = read_jsonl(
        next(
            p
            for p in runs.glob(f"*/control-*/{metrics}")
            if "twin" not in str(p) and "-from-" not in str(p)
        )
    )
    twins = [
        read_jsonl(p)
        for p in runs.glob(f"*/control-*twin-*/{metrics}")
        if "-from-" not in str(p.parents[1].name)
    ]
    out = []
    for pair in sorted(p for p in runs.iterdir() if p.is_dir()):
        before = next(pair.glob(f"test-*-to-step{at}-*/{metrics}"), None)
        after = next(pair.glob(f"test-*-resumed-*/{metrics}"), None)
        if before is None or after is None:
            continue
        test = joined(read_jsonl(before), read_jsonl(after))
        resumed = [read_jsonl(p) for p in pair.glob(f"control-*-from-*/{metrics}")]
        rules = REGISTRY.default_rules("twin" if resumed else "paired")
        main = [
            v
            for v in compare_all(rules, [control, *twins] if resumed else [control], test)
            if v.gate and not v.passed
        ]
        verdict = resumed_verdict(rules, [control], test, at_step=at, resumed_twins=resumed)
        out.append(
            {
                "pair": pair.name.split("toml_")[-1],
                "main_failing": [v.metric for v in main],
                "main_ratio": {
                    v.metric: v.details.get("max_ratio")
                    for v in compare_all(rules, [control, *twins] if resumed else [control], test)
                    if v.gate and v.metric in ("loss", "grad_norm", "grad_norm_parts")
                },
                "main_first": min(
                    (v.first_divergent_step for v in main if v.first_divergent_step), default=None
                ),
                "resumed_passed": None if verdict is None else verdict.passed,
                "resumed_first": None if verdict is None else verdict.first_divergent_step,
                "max_ratio": None if verdict is None else verdict.details["max_ratio_by_metric"],
                "gap_ratio": None if verdict is None else verdict.details["gap_ratio_by_metric"],
                "first_by_check": None
                if verdict is None
                else verdict.details["first_step_by_check"],
                "message": None if verdict is None else verdict.message,
            }
        )
    return out


def main() -> int:
    if sys.argv[1:2] == ["--rejudge"]:
        at = int(sys.argv[sys.argv.index("--at") + 1]) if "--at" in sys.argv else 400
        for line in rejudge(Path(sys.argv[2]), at):
            print(json.dumps(line))
        return 0
    if sys.argv[1:2] == ["--table"]:
        print(table([Path(p) for p in sys.argv[2:]]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--at", type=int, default=400, help="the step after which it resumes")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--cases", nargs="*", help="case names (default: all four)")
    parser.add_argument("--train-config", type=Path, default=DEBUG_CONFIG)
    parser.add_argument("--no-early-stop", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per pair")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    args = parser.parse_args()

    cases = [c for c in late_resume(args.at) if not args.cases or c.name in args.cases]
    if args.precision == "bf16":
        cases = [as_bf16(c) for c in cases]
    with tempfile.TemporaryDirectory(prefix="late-resume-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        pairs = build_pairs(cases, work, steps=args.steps, config=args.train_config.resolve())
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
            line = row(case, outcome, time.monotonic() - start)
            line.update(
                precision=args.precision,
                steps=args.steps,
                at=args.at,
                machine=machine(),
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            )
            record_line(args.out, line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Detection power and false-alarm rate of the default verdict, measured.

Runs every planted bug of the catalogue (must fail) and every correct pair (must pass) with the
default comparison rules and early stopping, through the library's Runner (what the pytest
plugin calls per item), on the built-in trainer (CPU/gloo, debug model). Prints a table and
writes it into BENCHMARKS.md (section "detection").

    python benchmarks/detection/run.py                 # the whole catalogue (~20-40 min, 2 cores)
    python benchmarks/detection/run.py --only ddp2 dp-ranks-read-same-shard --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # catalogue, pairs
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _report

from _report import machine, write_section
from catalogue import ALL, LATE_ONSET, LATE_RESUME, PRECISION, STEPS, Case
from pairs import DEBUG_CONFIG, build_pairs

from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner, RunSettings
from convergence.spec.job import JobSpec


@dataclass(frozen=True, kw_only=True)
class Row:
    case: Case
    outcome: PairOutcome
    wall_s: float

    @property
    def failing(self) -> list[str]:
        return [v.metric for v in self.outcome.verdicts if v.gate and not v.passed]

    @property
    def first_step(self) -> int | None:
        steps = [
            v.first_divergent_step
            for v in self.outcome.verdicts
            if v.gate and not v.passed and v.first_divergent_step is not None
        ]
        return min(steps) if steps else None

    @property
    def caught(self) -> bool:
        return self.outcome.status == "failed"

    def worst_ratio(self, metric: str) -> str:
        verdict = self.outcome.verdict(metric)
        if verdict is None:
            return "-"
        ratio = verdict.details.get("max_ratio")
        if ratio is not None:
            return f"{ratio:.2g}"
        return "pass" if verdict.passed else "FAIL"

    @property
    def test_s(self) -> float:
        test = self.outcome.test
        return test.wall_s if test is not None else float("nan")


def run_cases(
    cases: list[Case], *, steps: int, early_stop: bool, work: Path, config: Path = DEBUG_CONFIG
) -> list[Row]:
    pairs = build_pairs(cases, work, steps=steps, config=config)
    runner = Runner(
        RunSettings(
            work_dir=work / "work", early_stop=early_stop, idle_limit_s=300, wall_limit_s=1200
        )
    )
    rows = []
    for case in cases:
        start = time.monotonic()
        outcome = runner.run_pair(pairs[case.name])
        row = Row(case=case, outcome=outcome, wall_s=time.monotonic() - start)
        print(_line(row), flush=True)
        rows.append(row)
    return rows


def _line(row: Row) -> str:
    o = row.outcome
    what = (
        ("caught" if row.caught else "MISSED")
        if row.case.kind == "bug"
        else ("passed" if o.status == "passed" else f"FALSE ALARM ({o.status})")
    )
    extra = f" error: {o.error.splitlines()[0]}" if o.error else ""
    return (
        f"{row.case.kind:7s} {row.case.name:32s} {what:12s} failing={row.failing} "
        f"first={row.first_step} stopped={o.stopped_early_at} test_s={row.test_s:.1f}"
        f"{extra}"
    )


def bug_table(rows: list[Row], steps: int) -> str:
    out = [
        "| planted bug | layout | resume | caught | expected metric | failing metrics | "
        "first divergent step | stopped at step | test job s | what it is |",
        "|---|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        o = r.outcome
        expected_ok = all(m in r.failing for m in r.case.expect)
        caught = "yes" if r.caught else f"**no** ({o.status})"
        out.append(
            f"| {r.case.name} | {o.pair.test.layout.short_name()} | "
            f"{resume_cell(o.pair.test)} | {caught} | "
            f"{', '.join(r.case.expect)}{'' if expected_ok else ' (not failed)'} | "
            f"{', '.join(r.failing) or '-'} | {r.first_step or '-'} | "
            f"{o.stopped_early_at or f'ran {steps}'} | {r.test_s:.1f} | {r.case.note} |"
        )
    return "\n".join(out)


def resume_cell(job: JobSpec) -> str:
    """ "after 15 -> fsdp2-tp2" for a resuming test side (issue 29), "-" otherwise."""
    if job.resume is None:
        return "-"
    return f"after {job.resume.at_step} → {job.resume.layout.short_name()}"


def correct_table(rows: list[Row]) -> str:
    out = [
        "| correct pair | layout | resume | seed | regime | verdict | worst loss / tolerance | "
        "worst grad norm / tolerance | test job s |",
        "|---|---|---|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        o = r.outcome
        verdict = "pass" if o.status == "passed" else f"**{o.status.upper()}**"
        out.append(
            f"| {r.case.name} | {o.pair.test.layout.short_name()} | "
            f"{resume_cell(o.pair.test)} | {r.case.seed} | "
            f"{o.pair.regime} | {verdict} | {r.worst_ratio('loss')} | "
            f"{r.worst_ratio('grad_norm')} | {r.test_s:.1f} |"
        )
    return "\n".join(out)


def summary(bugs: list[Row], correct: list[Row], steps: int, total_s: float) -> str:
    caught = sum(r.caught for r in bugs)
    quarter = sum(1 for r in bugs if r.first_step is not None and r.first_step <= steps / 4)
    alarms = sum(r.outcome.status == "failed" for r in correct)
    errors = sum(r.outcome.status == "error" for r in [*bugs, *correct])
    lines = []
    if bugs:
        lines.append(
            f"Detection rate: **{caught}/{len(bugs)}** planted bugs caught by the "
            f"default rules ({quarter} of them diverging within the first quarter of "
            f"the {steps} steps)."
        )
    if correct:
        lines.append(f"False-alarm rate: **{alarms}/{len(correct)}** correct pairs failed.")
    if errors:
        lines.append(
            f"{errors} pair(s) ended in an error (a job crashed: no verdict, counted "
            "neither way; see the tables)."
        )
    ratios = {
        m: [
            r.outcome.verdict(m).details.get("max_ratio")
            for r in correct
            if r.outcome.verdict(m) is not None
        ]
        for m in ("loss", "grad_norm")
    }
    worst = {m: max((x for x in v if x is not None), default=None) for m, v in ratios.items()}
    if worst["loss"] is not None and worst["grad_norm"] is not None:
        # Headroom: how close the correct pairs came to a false alarm (1.0 = at the tolerance).
        lines.append(
            f"Headroom: the worst correct pair used {worst['loss']:.1%} of its loss "
            f"tolerance and {worst['grad_norm']:.2%} of its grad-norm tolerance."
        )
    lines.append(f"Whole run: {total_s / 60:.1f} min.")
    return " ".join(lines)


def _commit() -> str:
    import subprocess

    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def has_fsdp(case: Case) -> bool:
    par = case.parallelism
    return int(par.get("dp_shard", 1)) * int(par.get("cp", 1)) > 1


def as_bf16(case: Case) -> Case:
    """The case with bf16 parameters on both sides (the control group's too: precision)."""
    return dataclasses.replace(
        case, precision="bf16", techniques={**case.techniques, "param_dtype": "bfloat16"}
    )


def as_bf16_reduce(case: Case) -> Case:
    """The case whose *test* reduces its gradients in bf16 against the fp32 control (issue 28,
    "noise from the noisier side"): the pair is no longer bitwise pairable, so it gets the twin
    regime, whose envelope then holds the test's bf16 reduction noise too. The bugs must still
    fail through that wider envelope."""
    return dataclasses.replace(
        case,
        name=f"{case.name}-bf16-reduce",
        techniques={**case.techniques, "reduce_dtype": "bfloat16"},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--kind", choices=("bug", "correct"), help="only bugs / correct pairs")
    parser.add_argument("--no-early-stop", action="store_true")
    parser.add_argument(
        "--train-config",
        type=Path,
        default=DEBUG_CONFIG,
        help="train config of every pair (default: the shipped debug.toml)",
    )
    parser.add_argument(
        "--precision",
        choices=("as-declared", "bf16", "bf16-reduce"),
        default="as-declared",
        help="bf16: every case with bf16 params on both sides (FSDP mixed "
        "precision), i.e. the default regime a GPU user gets (twin); bf16-reduce: the test "
        "reduces gradients in bf16 against the fp32 control (twin with the test's numerics)",
    )
    parser.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    parser.add_argument(
        "--long",
        action="store_true",
        help="a long-horizon run of the --only cases (e.g. --steps 1000): written to its own "
        "section, detection-long-<precision>",
    )
    args = parser.parse_args()
    # The late-onset bugs and late resumes (issue 41) run only when named: they need --steps
    # past their start (benchmarks/detection/late_resume.py runs the resumes with their table).
    named_late = [c for c in (*LATE_ONSET, *LATE_RESUME) if args.only and c.name in args.only]
    cases = [
        c
        for c in (*ALL, *named_late)
        if (not args.only or c.name in args.only) and (args.kind is None or c.kind == args.kind)
    ]
    skipped: list[str] = []
    if args.precision in ("bf16", "bf16-reduce"):
        # bf16 params and bf16 reduction come from FSDP2's MixedPrecisionPolicy: a layout
        # without FSDP (dp_shard * cp == 1: DDP, TP or PP alone) would train in float32, so the
        # spec refuses it; those cases are left out and named. Precision-changing cases
        # already are what the bf16-reduce mode makes of the others.
        skipped = [c.name for c in cases if not has_fsdp(c)]
        convert = as_bf16 if args.precision == "bf16" else as_bf16_reduce
        cases = [
            convert(c)
            for c in cases
            if has_fsdp(c) and (args.precision == "bf16" or c not in PRECISION)
        ]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="detection-") as tmp:
        rows = run_cases(
            cases,
            steps=args.steps,
            early_stop=not args.no_early_stop,
            work=Path(tmp),
            config=args.train_config.resolve(),
        )
    total = time.monotonic() - start
    bugs = [r for r in rows if r.case.kind == "bug"]
    correct = [r for r in rows if r.case.kind == "correct"]
    command = (
        "python benchmarks/detection/run.py"
        + (f" --steps {args.steps}" if args.steps != STEPS else "")
        + (" --no-early-stop" if args.no_early_stop else "")
        + (f" --precision {args.precision}" if args.precision != "as-declared" else "")
        + (f" --kind {args.kind}" if args.kind else "")
        + (f" --long --only {' '.join(args.only or [])}" if args.long else "")
    )
    section, title = {
        "as-declared": ("detection", "Verdict quality: detection power and false alarms"),
        "bf16": (
            "detection-bf16",
            "Verdict quality in bf16: the same catalogue, bf16 params on both sides",
        ),
        "bf16-reduce": (
            "detection-bf16-reduce",
            "Verdict quality with a bf16-reduce test against an fp32 control: the same catalogue",
        ),
    }[args.precision]
    if args.kind and not args.long:
        # one kind only (e.g. the bugs re-run after an envelope change): its own section, so
        # the full run's section (both kinds) is not overwritten by half of it
        section, title = f"{section}-{args.kind}", f"{title} ({args.kind}s only)"
    if args.long:
        label = "fp32" if args.precision == "as-declared" else args.precision
        section = f"detection-long-{label}"
        title = f"Verdict quality over {args.steps} steps ({label}, the cases named)"
    body = "\n\n".join(
        part
        for part in (
            f"## {title} (benchmarks/detection/run.py)",
            f"Machine: {machine()}. Commit {_commit()}. `{command}`: debug model, {args.steps} steps, control FSDP(2) "
            "per seed and precision, default comparison rules (loss, grad norm, per-part grad norm "
            "and data fingerprint, paired regime "
            "for fp32, twin regime for bf16: the control's twin FSDP(4) with half the local batch "
            "measures the noise envelope), early stopping on. Planted "
            "bugs are parallelism hooks in benchmarks/detection/detection_bugs/ (each docstring "
            'names the real bug it stands for). "test job s" is the time to verdict once the '
            "control is cached.",
            summary(bugs, correct, args.steps, total)
            + (
                f" Left out (no FSDP, so no mixed precision: neither bf16 params nor a bf16 reduction): {', '.join(skipped)}."
                if skipped
                else ""
            ),
            bug_table(bugs, args.steps) if bugs else "",
            correct_table(correct) if correct else "",
        )
        if part
    )
    print("\n" + body)
    if (
        not args.no_write
        and (not args.only or args.long)
        and args.train_config.resolve() == DEBUG_CONFIG
    ):
        write_section(section, body)
    missed = sum(not r.caught for r in bugs)
    alarms = sum(r.outcome.status != "passed" for r in correct)  # errors fail the script
    return 1 if missed or alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())

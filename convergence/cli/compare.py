"""``convergence compare`` and ``convergence export-golden``: judging runs made elsewhere.

Both read runs through :func:`convergence.metrics.reader.read_metrics` (our run folders,
torchtitan/TensorBoard dumps, JSONL files, golden files). ``compare`` judges with the rules
pytest uses (loss, grad norm and per-part grad norm by the regime's method, the data
fingerprint exactly, all gating; throughput and memory reported only) and prints the text of
pytest's failure section.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from convergence.calibration.select import select_calibration
from convergence.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, option_values
from convergence.metrics.curve import RunMetrics
from convergence.metrics.golden import export_golden
from convergence.metrics.reader import describe_source, read_run
from convergence.options import (
    CLI_WORKDIR,
    OPTIONS,
    add_arguments,
)
from convergence.regimes import REGISTRY, get_regime
from convergence.report.formats.failure_text import render_outcome
from convergence.run.judge import judge
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.run.settle import settle
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import METHODS, METRICS, ComparisonRule, Method, PairSpec
from convergence.stats.provenance import golden_provenance, read_run_meta
from convergence.stats.types import MetricVerdict

#: Session options ``compare`` takes: the workdir, where this stack's calibration is found.
COMPARE_OPTIONS = ("workdir",)

#: The metrics that gate by default (from the rules, so the help cannot drift from them).
GATING = ", ".join(r.metric for r in REGISTRY.default_rules("paired") if r.gate)
REPORTED = ", ".join(r.metric for r in REGISTRY.default_rules("paired") if not r.gate)


# -- compare --------------------------------------------------------------------------------


def add_compare_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    compare = sub.add_parser(
        "compare",
        help="compare two finished runs (A = control), with pytest's default verdict",
        description=f"Judge run B against run A with the rules pytest uses: {GATING} gate "
        f"(the data fingerprint exactly, the others by the regime's method; a "
        f"metric that a run does not log is reported as not compared), {REPORTED} "
        f"reported only. "
        "A run is a run folder, a torchtitan dump / TensorBoard folder, a "
        "metrics.jsonl file or a golden JSON file.",
    )
    compare.add_argument("a", help="control: run folder, TensorBoard folder, JSONL or golden")
    compare.add_argument("b", help="test: run folder, TensorBoard folder, JSONL or golden")
    compare.add_argument(
        "--replicate",
        action="append",
        default=[],
        metavar="RUN",
        help="another control run (repeatable): another seed's (the seed "
        "regime, the default with any: a band of A + these) or, with "
        "--regime twin, the control's twin",
    )
    compare.add_argument(
        "--regime",
        choices=REGISTRY.names(),
        default=None,
        help="paired (same seed checkpoint and data; default), twin (the "
        "envelope from the control's twin: --replicate TWIN_RUN) or seed "
        "(a band of A and the --replicate runs; default with any)",
    )
    compare.add_argument(
        "--metric",
        action="append",
        default=None,
        choices=METRICS,
        help=f"gate on these metrics only (repeatable; default: pytest's "
        f"{GATING}, plus {REPORTED} reported)",
    )
    compare.add_argument(
        "--method",
        default=None,
        choices=METHODS,
        help="comparison method for the gating metrics "
        "(default: the regime's: paired, twin or seed)",
    )
    # The calibration is this stack's under the workdir, as for pytest and `convergence run`.
    add_arguments(
        compare,
        skip=[opt.name for opt in OPTIONS if opt.name not in COMPARE_OPTIONS],
        help_for={
            "workdir": "where this stack's calibration is looked up (nothing runs, nothing "
            "is cached; default: ./.convergence, in the folder you run it from)"
        },
    )
    compare.set_defaults(func=cmd_compare)


def compare_rules(
    metrics: Sequence[str] | None, method: Method | None, regime: str
) -> tuple[ComparisonRule, ...]:
    """pytest's default rules for ``regime``, narrowed to ``metrics`` / with ``method``."""
    if metrics:
        default = get_regime(regime).method
        return tuple(ComparisonRule(metric=m, method=method or default) for m in metrics)
    rules = get_regime(regime).default_rules()
    if method is None:
        return rules
    return tuple(ComparisonRule(metric=r.metric, method=method) if r.gate else r for r in rules)


def cmd_compare(args: argparse.Namespace) -> int:
    values = option_values(args, "compare")
    if values is None:
        return EXIT_USAGE
    paths = [Path(args.a), *map(Path, args.replicate)]
    controls = [read_run(p) for p in paths]
    test = read_run(Path(args.b))
    regime = args.regime or REGISTRY.default_for_runs(len(controls))
    get_regime(regime).check_control_runs(len(controls))
    rules = compare_rules(args.metric, args.method, regime)
    _check_requested(args.metric or [], paths, controls, Path(args.b), test)
    pair = _pair(paths, Path(args.b), rules, regime, replicates=len(controls))
    calibration = select_calibration((values["workdir"] or CLI_WORKDIR).resolve())
    verdicts = judge(
        pair, controls, test, calibration, test_meta=read_run_meta(Path(args.b))
    ).verdicts
    outcome = _outcome(pair, paths, controls, Path(args.b), test, verdicts)
    print(render_outcome(outcome, show_layouts=False))
    return EXIT_OK if outcome.status == "passed" else EXIT_FAILED


def _check_requested(
    metrics: Sequence[str],
    paths: Sequence[Path],
    controls: Sequence[RunMetrics],
    test_path: Path,
    test: RunMetrics,
) -> None:
    """A metric asked for by name must be in every run (the defaults may be missing and are
    then reported as not compared, as in pytest)."""
    for metric in metrics:
        for path, run in [*zip(paths, controls, strict=True), (test_path, test)]:
            if metric not in run:
                raise SpecError(
                    f"run has no {metric!r} curve",
                    file=str(path),
                    key="--metric",
                    fix=f"choose --metric among {', '.join(sorted(run))}",
                )


def _labels(control: Path, test: Path) -> tuple[str, str]:
    """Names for the two runs: the last path segments, as many as it takes to tell them apart
    (two TensorBoard dumps both end in ``dump/tb``: "tb vs tb" named neither)."""
    a, b = control.resolve().parts, test.resolve().parts
    for k in range(1, max(len(a), len(b)) + 1):
        la, lb = "/".join(a[-k:]), "/".join(b[-k:])
        if la != lb:
            return la, lb
    return control.name, test.name


def _pair(
    paths: Sequence[Path],
    test_path: Path,
    rules: tuple[ComparisonRule, ...],
    regime: str,
    *,
    replicates: int,
) -> PairSpec:
    """The pair the two runs stand for: named by the paths, judged by ``rules``; a golden file
    as the control is the pair's golden (its provenance note)."""
    control_label, test_label = _labels(paths[0], test_path)

    def job(path: Path, label: str) -> JobSpec:
        # A job name is one path segment (it names run folders); the full path is the source.
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", label) or "run"
        return JobSpec(name=name, train_config=path, source=str(path))

    return PairSpec(
        pair_id=f"compare {test_label} vs {control_label}",
        control=job(paths[0], control_label),
        test=job(test_path, test_label),
        rules=rules,
        regime=regime,
        replicates=max(2, replicates),
        early_stop=False,
        golden=str(paths[0]) if describe_source(paths[0]) == "golden" else None,
    )


def _outcome(
    pair: PairSpec,
    paths: Sequence[Path],
    controls: Sequence[RunMetrics],
    test_path: Path,
    test: RunMetrics,
    verdicts: tuple[MetricVerdict, ...],
) -> PairOutcome:
    # As the Runner keeps them: what the regime keeps (the seed band's replicates, the twin).
    kept = get_regime(pair.regime).control_curves(controls)
    settled = settle(pair, verdicts, controls[0], twins=kept.twins)
    control = SideOutcome(
        job=pair.control,
        metrics=controls[0],
        run_dir=paths[0],
        replicates=kept.replicates,
        twins=kept.twins,
    )
    return PairOutcome(
        pair=pair,
        status=settled.status,
        error=settled.error,
        control=control,
        test=SideOutcome(job=pair.test, metrics=test, run_dir=test_path),
        verdicts=verdicts,
    )


# -- export-golden --------------------------------------------------------------------------


def add_export_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    export = sub.add_parser("export-golden", help="save a run's curves as a golden file")
    export.add_argument("run_dir", help="run folder, TensorBoard folder or metrics.jsonl")
    export.add_argument("out", help="golden JSON file to write")
    export.set_defaults(func=cmd_export_golden)


def cmd_export_golden(args: argparse.Namespace) -> int:

    path = Path(args.run_dir)
    metrics = read_run(path)
    metadata = golden_provenance(path, source_kind=describe_source(path))
    export_golden(metrics, Path(args.out), metadata=metadata)
    env = metadata["environment"]
    print(
        f"golden curves ({', '.join(sorted(metrics))}) written to {args.out} "
        f"(torch {env['torch']}, {env['hardware']}, commit {metadata['git_commit'] or '-'})"
    )
    return EXIT_OK


__all__ = [
    "add_compare_parser",
    "add_export_parser",
    "cmd_compare",
    "cmd_export_golden",
    "compare_rules",
    "read_run",
]

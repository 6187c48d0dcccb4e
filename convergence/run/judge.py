"""The one place a verdict is made: a pair's rules applied to its control curves and its test
curve, under a given calibration.

Every front end reaches its verdict here -- the Runner (pytest, ``convergence run``,
``bisect``, the nightly's pytest), ``convergence compare`` and ``convergence ab`` -- so the
same curves under the same calibration get the same verdict wherever they are judged
(tests/test_one_judge.py). What it adds to the comparisons (stats/registry.py):

- the calibration is the one handed in, in force while the comparisons run (the calibrated
  methods read it: stats/paired_band.py, stats/twin_envelope.py), not whatever the process selected last;
- each verdict of a calibrated method says whose parameters it used: its tolerance text
  (report.json/.md/.html, the failure text) and ``details["floors"]`` (saved outcomes,
  JUnit's ``convergence.floors``);
- a golden control recorded with another torch or GPU says so on the loss verdict.

The pair's status from these verdicts is settled in one place too: run/settle.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.calibration.select import Selection, in_force
from convergence.checks import Ran, checks_of
from convergence.metrics.curve import RunMetrics
from convergence.spec.pair import PairSpec
from convergence.stats.provenance import with_golden_note
from convergence.stats.registry import compare_all, get_comparison
from convergence.stats.types import MetricVerdict


@dataclass(frozen=True)
class Judgement:
    verdicts: tuple[MetricVerdict, ...]
    """One per rule of the pair, in the rules' order."""

    @property
    def passed(self) -> bool:
        """Every gating verdict passed (the pair's status is settled in run/settle.py)."""
        return all(v.passed for v in self.verdicts if v.gate)


def judge(
    pair: PairSpec,
    controls: Sequence[RunMetrics],
    test: RunMetrics,
    calibration: Selection,
    *,
    test_meta: Mapping[str, Any] | None = None,
    upto: int | None = None,
    ran: Ran | None = None,
) -> Judgement:
    """``test`` judged against ``controls`` (the control first, then what its regime runs
    beside it: twins, seed replicates) by ``pair.rules`` under ``calibration``, then by the
    pair's checks (convergence/checks/: anchored, resumed, ...) on what ``ran`` (the Runner's
    jobs, the checks' extra jobs among them; None: curves without their jobs, as `compare`
    has them -- no check has its evidence).

    ``upto``: the last step the test ran when it was stopped early -- the controls are cut
    there, so "incomplete" fails no metric (the sequential monitor already saw a gating metric
    clearly outside). ``test_meta``: the test run's metadata (the golden note compares its
    environment with the golden file's).
    """
    runs = list(controls)
    if upto is not None:
        runs = [{m: c.upto(upto) for m, c in run.items()} for run in runs]
    with in_force(calibration):
        verdicts = compare_all(pair.rules, runs, test)
        if ran is not None:
            for check in checks_of(pair):
                verdicts = check.verdicts(pair, ran, verdicts)
    verdicts = with_calibration_note(verdicts, calibration)
    if pair.golden:
        verdicts = with_golden_note(Path(pair.golden), verdicts, test_meta or {})
    return Judgement(tuple(verdicts))


def with_calibration_note(
    verdicts: Sequence[MetricVerdict], calibration: Selection
) -> tuple[MetricVerdict, ...]:
    """Each verdict of a calibrated method (paired, twin) names the calibration it used."""
    out = []
    for v in verdicts:
        if not get_comparison(v.method).calibrated or v.not_compared or v.metric == "lr":
            out.append(v)
            continue
        tolerance = f"{v.tolerance} [{calibration.label()}]" if v.tolerance else v.tolerance
        details = {**v.details, "floors": calibration.to_json()}
        out.append(dataclasses.replace(v, tolerance=tolerance, details=details))
    return tuple(out)

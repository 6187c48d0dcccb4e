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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.calibration.select import Selection, in_force
from convergence.metrics.curve import RunMetrics
from convergence.run.outcome import PairStatus
from convergence.spec.pair import PairSpec
from convergence.stats.anchored import anchored_verdict, judged_from_anchors
from convergence.stats.provenance import with_golden_note
from convergence.stats.registry import compare_all, get_comparison
from convergence.stats.resumed import resumed_verdict
from convergence.stats.types import MetricVerdict


@dataclass(frozen=True)
class Judgement:
    verdicts: tuple[MetricVerdict, ...]
    """One per rule of the pair, in the rules' order."""

    @property
    def passed(self) -> bool:
        """Every gating verdict passed."""
        return all(v.passed for v in self.verdicts if v.gate)

    @property
    def status(self) -> PairStatus:
        return status_of(self.verdicts)


def status_of(verdicts: Sequence[MetricVerdict]) -> PairStatus:
    """passed when every gating verdict passed; failed when one failed outright; else (the
    rest are inconclusive: stats/noninferiority.py) inconclusive -- a failure outweighs it."""
    gating = [v for v in verdicts if v.gate]
    if all(v.passed for v in gating):
        return "passed"
    if any(not v.passed and not v.inconclusive for v in gating):
        return "failed"
    return "inconclusive"


def judge(
    pair: PairSpec,
    controls: Sequence[RunMetrics],
    test: RunMetrics,
    calibration: Selection,
    *,
    test_meta: Mapping[str, Any] | None = None,
    upto: int | None = None,
    anchored: RunMetrics | None = None,
    anchored_twins: Sequence[RunMetrics] = (),
    resumed_twins: Sequence[RunMetrics] = (),
) -> Judgement:
    """``test`` judged against ``controls`` (the control first, then what its regime runs
    beside it: twins, seed replicates) by ``pair.rules`` under ``calibration``.

    ``upto``: the last step the test ran when it was stopped early -- the controls are cut
    there, so "incomplete" fails no metric (the sequential monitor already saw a gating metric
    clearly outside). ``test_meta``: the test run's metadata (the golden note compares its
    environment with the golden file's). ``anchored``: the test layout's anchored steps
    (``pair.anchor_every``; convergence/run/anchors.py), judged after the rules as one more
    verdict, ``anchored`` (stats/anchored.py), on the controls' full curves;
    ``anchored_twins``: the twins' one step from the same anchors (twin rules' tolerance).
    ``resumed_twins``: a resuming test's twins run again from its checkpoint (the regime's
    ``resumed_controls``), judging the steps after the resume as one more verdict, ``resumed``
    (stats/resumed.py).
    """
    runs = list(controls)
    resumed = list(resumed_twins)
    if upto is not None:
        runs = [{m: c.upto(upto) for m, c in run.items()} for run in runs]
        resumed = [{m: c.upto(upto) for m, c in run.items()} for run in resumed]
    with in_force(calibration):
        verdicts = compare_all(pair.rules, runs, test)
        if anchored is not None:
            one_step = anchored_verdict(
                pair.rules,
                controls,
                anchored,
                every=pair.anchor_every,
                anchored_twins=anchored_twins,
            )
            # Past the first steps the anchored check judges "same function" for the
            # metrics it covers; their trajectories are reported (stats/anchored.py).
            verdicts = (*judged_from_anchors(verdicts, one_step), one_step)
        if resumed and pair.test.resume is not None:
            after = resumed_verdict(
                pair.rules, runs, test, at_step=pair.test.resume.at_step, resumed_twins=resumed
            )
            verdicts = (*verdicts, *([after] if after is not None else []))
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

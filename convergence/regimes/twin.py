"""``twin``: same seed checkpoint and data, but not bitwise reproducible (bf16, compile,
nondeterministic kernels). The noise envelope is measured, not assumed: the pair runs a twin of
the control that differs only by legitimate rounding, derived by the control's backend
(``Backend.noise_twin``: another data-parallel degree, the same samples; beside it the
forward-noise twin and the twin with the test's numerics), and the test may deviate from the
control by at most k x the sum over the twins of the running max of |twin - control| (each twin
measures one source of rounding, a layout carries several) plus a small relative floor
(convergence/stats/twin_envelope.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from convergence.metrics.curve import RunMetrics
from convergence.regimes.base import FORWARD_TWIN, ControlCurves, ShippedRegime, TwinSource
from convergence.regimes.paired import check_same_seed
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import Method, PairSpec


@dataclass(frozen=True)
class TwinRegime(ShippedRegime):
    name: str = "twin"
    method: Method = "twin"
    method_needs: str = "it compares with a twin of the control that only that regime runs"

    def claims(self, control: JobSpec, test: JobSpec, *, twins: bool) -> bool:
        # Asked after paired: same seed checkpoint and data but not bitwise reproducible, and
        # both sides' backends derive twins (Capabilities.twins_by_default); else the seed band.
        return control.seed == test.seed and twins

    def check(self, pair: PairSpec, *, key: str, backend: TwinSource) -> None:
        check_same_seed(pair, key=key)
        if pair.golden:
            return  # a golden curve is the control: no twin runs
        try:
            self.control_jobs(pair, backend)
        except SpecError as exc:
            raise SpecError(
                f"[control {pair.control.name!r}] {exc.detail}",
                file=pair.source,
                key=f"{key}.regime",
                fix=exc.fix,
            ) from None

    def control_jobs(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        """The control, then its twins; SpecError (with a fix) when there is no noise twin.

        - the noise twin (``Backend.noise_twin``: another DP degree, the reduction reordered);
        - the forward-noise twin where the backend derives one (``Backend.forward_twin``: the
          forward rounded differently at every step, as TP/SP/CP layouts do): one rounding as
          TP2, and for a test of a larger TP degree one more per doubling up to it
          (``forward_twin_degrees``);
        - where the test's numerics differ from the control's (param or reduce dtype, compile,
          determinism): the noise twin of the control *run with the test's numerics*, so the
          envelope also measures the noisier side's own noise (noise from the noisier side).

        All are control-side jobs (no test code in them): cached and shared like the control.
        """
        control = pair.control
        twin = backend.noise_twin(control)
        if twin is None:
            raise SpecError(
                f"the twin regime derives the control's twin from its backend; "
                f"the {control.backend!r} backend derives none",
                key="regime",
                fix='use regime = "seed" for this backend',
            )
        jobs = [control, twin]
        forward = getattr(backend, FORWARD_TWIN, None)
        if forward is not None:
            for degree in forward_twin_degrees(pair.test.layout.tp):
                if (fwd := forward(control, tp=degree)) is not None:
                    jobs.append(fwd)
        numerics = test_numerics(control, pair.test)
        if numerics is not None:
            noisier = backend.noise_twin(numerics)
            if noisier is not None:
                jobs.append(noisier)
        return tuple(jobs)

    def resumed_controls(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        """A resuming test: its twins again, each loading the test's checkpoint and training
        to the end (run/resume.py). Why: after K steps the twins' envelope has grown 5-7x
        (BENCHMARKS "Twin envelope, long horizon"), so a layout broken from step K+1 passes
        it; twins that start from the test's own state at K measure the noise from there (and
        hold any drift the test brought to K, which they start from too). stats/resumed.py
        judges the steps after K against them."""
        return self.control_jobs(pair, backend)[1:]

    def check_control_runs(self, count: int) -> None:
        if count < 2:
            raise SpecError(
                "the twin regime needs the control's twin run",
                key="--replicate",
                fix="add --replicate TWIN_RUN: the control layout with another DP "
                "degree, same seed and data (README: Reading the verdict)",
            )

    def control_curves(self, runs: Sequence[RunMetrics]) -> ControlCurves:
        # The test is compared with the control itself; the twins only set the envelope.
        return ControlCurves(twins=tuple(runs[1:]))


def forward_twin_degrees(test_tp: int) -> list[int]:
    """The TP degrees of the forward-noise twins for a test of TP degree ``test_tp``: 2, then
    each doubling below the test's degree, then the test's (TP4: 2 and 4; TP8: 2, 4, 8).

    Why more than one: the twins' noises add up (each twin one source of rounding), and a TP4
    all-reduce sums four rounded partials -- in a tree, pairs of quarters and then the two
    halves: the halves' rounding is a TP2 twin's, the quarters' a TP4 twin's. One twin of the
    test's degree alone is not the test's rounding bit for bit (gloo or NCCL add the four in
    their own order), and its one-step gaps are heavy-tailed: measured on config D at one seed
    (BENCHMARKS.md "TP4"), a correct FSDP2+TP4 left the anchored tolerance of the TP2 twin in
    5 of 10 pseudo-pairs, of a TP4 twin alone in 3, of both twins in 0 (largest share 0.71);
    judged after that on held-back seeds and config H. A test without TP (CP, PP, ...) keeps
    the one TP2 twin: its forward re-rounds too, and that twin was calibrated for it."""
    degrees = [2]
    while degrees[-1] * 2 < test_tp:
        degrees.append(degrees[-1] * 2)
    if test_tp > 2:
        degrees.append(test_tp)
    return degrees


#: Technique fields that change a run's rounding, not its math: a test that changes one of them
#: from the control's is noisier (or quieter) than the control in its own way.
NUMERICS_FIELDS = ("param_dtype", "reduce_dtype", "compile", "deterministic")


def test_numerics(control: JobSpec, test: JobSpec) -> JobSpec | None:
    """The control run with the test's numerics (None: the test keeps the control's)."""
    changed = {
        name: getattr(test.techniques, name)
        for name in NUMERICS_FIELDS
        if getattr(test.techniques, name) != getattr(control.techniques, name)
    }
    if not changed:
        return None
    tag = "-".join(f"{k}={v}" for k, v in sorted(changed.items()))
    return dataclasses.replace(
        control,
        name=f"{control.name}-as-test-{tag}",
        techniques=dataclasses.replace(control.techniques, **changed),
    )


TWIN = TwinRegime()

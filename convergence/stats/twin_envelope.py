"""``twin``: the paired regime for runs that are not bitwise reproducible (bf16, compile,
nondeterministic kernels), with a noise envelope *measured* on the same pair.

Why not the seed band: a bf16 test starts from the same seed checkpoint and reads the same
samples as its control, so before chaos sets in the two curves agree far more closely than two
seeds do. A band sized by seed-to-seed spread is hundreds of times wider than that agreement at
the first steps, exactly where most parallelism bugs show (BENCHMARKS.md: the seed regime let a
missing row-wise all-reduce, a CP mask offset and a CP rotary offset pass).

The envelope. Besides the control, the session runs a *twin* of it: the same layout family,
seed checkpoint, samples and precision, changed only in a way that is numerically legitimate --
twice the data-parallel degree with half the local batch (Backend.noise_twin), so
every gradient is reduced in another order and rounded at other points, as a new layout's would
be. ``|twin - control|`` at step s is how far legitimate rounding noise alone moved the curve
after s steps. The tolerance is

    tol(step) = k * noise(step) + atol * (1 + growth * sqrt(step)) + rtol * |control(step)|

- ``noise(step)`` is the running maximum of |twin - control| up to that step (up to
  ``pool`` steps after it), *summed* over the twins (each twin isolates one source of
  rounding, a layout carries several at once: see :func:`twin_noise`): the noise twin,
  the forward-noise twin (the forward re-rounded at every step, as TP/SP/CP layouts do) and,
  when the test's numerics differ from the control's, the noise twin of the control run with
  the test's numerics (convergence/regimes/twin.py; BENCHMARKS.md "Twin envelope on other
  models"). Two trajectories
  pushed apart by rounding drift apart and stay apart (chaos amplifies, it does not heal); that
  they cross at some step says nothing about how far noise can move them, so the envelope never
  narrows back to a crossing.
- ``k`` (multiplier, ``rule.z``) because one twin is one sample of the noise, and a test layout
  rounds in more places than the twin (TP splits every matmul, not only the reduction).
- The floor (``atol``, ``growth``, ``rtol``) covers the first steps, where the twin can agree
  with the control bit for bit (a DP change does not touch the forward pass) while a TP or CP
  layout already rounds its forward differently: bf16 keeps 8 significant bits, so a loss of
  ~5 computed in another order can move by ~1e-3 at step 1.

The defaults are calibrated on CPU bf16 (FSDP2 mixed precision, debug model) against the
detection catalogue: see :data:`TWIN_DEFAULTS` and BENCHMARKS.md ("Verdict quality in bf16").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from convergence.calibration.select import calibrated
from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule, Method
from convergence.stats._common import (
    ComparisonDefaults,
    Floats,
    Ints,
    align,
    failed,
    point_check,
    tolerance_at,
)
from convergence.stats.paired_band import PairedTolerance, envelope_verdict, paired_tolerance
from convergence.stats.types import Check, MetricVerdict, Tolerance


@dataclass(frozen=True, kw_only=True)
class TwinTolerance:
    """k x the measured noise, plus a floor; ``at`` gives the tolerance at the test's steps."""

    k: float
    atol: float
    growth: float
    rtol: float
    noise_steps: Ints
    """Steps where both the control and the twin logged the metric (ascending)."""
    noise: Floats
    """Running max of |twin - control| at ``noise_steps``, summed over the twins."""

    def measured(self, steps: Ints) -> Floats:
        """The noise in force at each step: the running max up to the latest step <= it."""
        if self.noise.size == 0:
            return np.zeros(steps.shape, dtype=np.float64)
        index = np.searchsorted(self.noise_steps, steps, side="right") - 1
        return np.where(index >= 0, self.noise[np.clip(index, 0, None)], 0.0)

    def at(self, steps: Ints, control: Floats) -> Floats:
        floor = self.atol * (1.0 + self.growth * np.sqrt(steps.astype(np.float64)))
        return self.k * self.measured(steps) + floor + self.rtol * np.abs(control)

    def describe(self) -> str:
        return (
            f"{self.k:g} x sum over twins of |twin - control| (running max) + atol {self.atol:g}"
            f"*(1+{self.growth:g}*sqrt(step)) + rtol {self.rtol:g}*|control|"
        )


@dataclass(frozen=True, kw_only=True)
class TwinDefaults:
    k: float
    atol: float
    growth: float
    rtol: float
    pool: int = 2
    """Steps ahead whose twin gaps the envelope at a step also takes (see ``twin_noise``)."""


#: Calibrated on CPU bf16 (BENCHMARKS.md, "Verdict quality in bf16"). Other metrics use the
#: loss's. ``lr`` comes from the schedule, so it needs no twin: its floor is float64 rounding.
TWIN_DEFAULTS: dict[str, TwinDefaults] = {
    "loss": TwinDefaults(k=3.0, atol=0.0, growth=0.0, rtol=2e-5),
    "val_loss": TwinDefaults(k=3.0, atol=0.0, growth=0.0, rtol=2e-5),
    "grad_norm": TwinDefaults(k=3.0, atol=0.0, growth=0.0, rtol=1e-4),
    "grad_norm_parts": TwinDefaults(k=3.0, atol=0.0, growth=0.0, rtol=5e-4),
    "update_norm_parts": TwinDefaults(k=3.0, atol=0.0, growth=0.0, rtol=5e-4),
    "lr": TwinDefaults(k=0.0, atol=1e-12, growth=0.0, rtol=1e-9),
}


def twin_noise(control: Curve, twins: Sequence[Curve], pool: int = 0) -> tuple[Ints, Floats]:
    """(steps, sum over the twins of each twin's running max of |twin - control|).

    Why the sum, not the noisiest twin: each twin isolates one source of legitimate rounding
    -- the noise twin the reduction order, the forward-noise twin the forward's re-rounding,
    the twin with the test's numerics the test's own precision -- while a test layout carries
    several at once (TP re-rounds its forward *and* reduces in another order). To first order
    the perturbations superpose, so the layout's gap is bounded by the sum of the sources'
    gaps (triangle inequality), not by the largest one. Measured on the saved curves of three
    configs and two seeds (benchmarks/detection/envelope_candidates.py, BENCHMARKS.md "Twin
    envelope constructions"): with the noisiest twin, 3 of 31 correct pairs left the envelope
    late (steps 40-43, 1.2-1.7x). The gap at one step is a heavy-tailed draw: on config C the
    gaps of every run jump 10-100x together at a few steps (37, 43, 55), and at step 43 the TP
    layout drew 5x the noisiest twin's draw. With the sum: 0 of 31, and every planted bug
    still fails by step 15 of 60, at the same k = 3. What else was tried on the same curves:
    pooling 5-10 steps ahead or the twins' gaps to each other as an extra draw left B's
    interleaved-PP pair failing; a chaos growth floor (the envelope keeps growing as
    (step/s)^alpha after the twins' gaps stop) left C's TP pairs failing and moved bugs past
    step 15. What the sum costs: the weakest bug (a row-wise all-reduce left out) fails at
    step 14 instead of 9-12. The honest limit: on these curves the window of k that gives 0
    false alarms and every bug by step 15 is ~1.2x wide for every construction (sum: k
    2.8-3.3); the sum puts the shipped k inside it, for a reason that does not depend on them.

    Each twin's running max is held at steps it did not log. ``pool`` > 0: the noise at a
    step is the running max up to ``pool`` logged steps later.
    Why: the gap at one step is one draw, and the ratio of two such draws (the test's gap over
    the twin's) is heavy-tailed -- at step 1, with nothing before it to take a maximum over, a
    twin that happened to land close to the control makes k x its gap a needle's eye (measured:
    without pooling, a correct bf16-reduce test fails grad norm at step 1 at 5x the twin's gap
    there, 0.8x its gap at step 3). Pooling the next steps' draws sizes the first steps' envelope on three
    draws, not one; later steps barely change (the running max already pools). The envelope is
    built after the control and its twins finished, so the later steps are known.
    """
    steps: Ints = control.steps.astype(np.int64)
    total = np.zeros(steps.shape, dtype=np.float64)
    seen = np.zeros(steps.shape, dtype=bool)
    for twin in twins:
        pairs = align(control, twin)
        index = np.searchsorted(steps, pairs.steps)
        gap = np.abs(pairs.test - pairs.control)
        # A NaN in a twin is no evidence of noise (the twin's own health is checked apart).
        worst = np.zeros(steps.shape, dtype=np.float64)
        worst[index] = np.where(np.isfinite(gap), gap, 0.0)
        # Running max over the control's steps: a step this twin skipped holds its last max.
        total += np.maximum.accumulate(worst)
        seen[index] = True
    kept_steps = steps[seen]
    if not kept_steps.size:
        return kept_steps, total[seen]
    running = total[seen]
    ahead = np.minimum(np.arange(running.size) + max(pool, 0), running.size - 1)
    return kept_steps, running[ahead]


def twin_tolerance(rule: ComparisonRule, control: Curve, twins: Sequence[Curve]) -> TwinTolerance:
    base = calibrated("twin", rule.metric, TWIN_DEFAULTS.get(rule.metric, TWIN_DEFAULTS["loss"]))
    steps, noise = twin_noise(control, twins, pool=base.pool)
    return TwinTolerance(
        k=base.k if rule.z is None else rule.z,
        atol=base.atol if rule.atol is None else rule.atol,
        growth=base.growth if rule.growth is None else rule.growth,
        rtol=base.rtol if rule.rtol is None else rule.rtol,
        noise_steps=steps,
        noise=noise,
    )


#: The anchored twin envelope's multiplier of the measured one-step noise. The twin regime's
#: k = 3 stands for the draws it does not see: its envelope at a step is one draw per twin
#: (pooled over three steps). Here each twin's noise is already its largest gap over every
#: anchor of the run (19 draws at anchor_every 25 of 500 steps), summed over the twins, so
#: less is needed for the tail. Measured on the debug model in bf16 (BENCHMARKS.md "The
#: anchored check"), the window is narrow: a correct FSDP(2)+TP(2) reached 1.84x of the k = 1
#: envelope on the loss at one anchor of 19 (a false alarm below k = 1.84), while the late
#: CP-rope bug's first anchored step was 1.75x of it (missed at that anchor above k = 1.75);
#: 2 keeps the correct layouts in (no false alarm measured); the CP-rope bug is left to the
#: persistence rule below (which catches it at anchor 375, not 300).
ONE_STEP_K = 2.0


@dataclass(frozen=True, kw_only=True)
class AnchoredTwinTolerance:
    """The twin envelope of one step: k x the sum over the twins of each one's largest
    *relative* one-step gap over the anchors, times |control|, plus the paired floor.

    Each twin trained the same one step from the same anchors (a control-side anchored job),
    so its gap to the control is one step of legitimate rounding from an identical state --
    many draws, one per anchor, at the run's own states. One step of rounding does not grow
    with the horizon, so the draws of all anchors pool into one maximum (relative: the grad
    norm's scale moves over a run). The floor is the fp32 paired floor at step 1 (where the
    twins agree bit for bit, as a DP twin's loss does)."""

    k: float
    relative_noise: float
    """Sum over the twins of max over the anchors of |twin - control| / |control|."""
    floor: PairedTolerance

    @property
    def atol(self) -> float:
        return self.floor.atol

    @property
    def growth(self) -> float:
        return 0.0

    @property
    def rtol(self) -> float:
        return self.k * self.relative_noise + self.floor.rtol

    def at(self, steps: Ints, control: Floats) -> Floats:
        return self.floor.at(steps, control) + self.k * self.relative_noise * np.abs(control)

    def describe(self) -> str:
        return (
            f"{self.k:g} x sum over the anchored twins of max |twin - control|/|control| "
            f"({self.relative_noise:.3g}) x |control| + {self.floor.describe()}"
        )


def relative_one_step_noise(control: Curve, twins: Sequence[Curve]) -> float:
    """Sum over the anchored twins of each one's largest |twin - control| / |control|."""
    total = 0.0
    for twin in twins:
        pairs = align(control, twin)
        if pairs.steps.size == 0:
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            gap = np.abs(pairs.test - pairs.control) / np.abs(pairs.control)
        gap = gap[np.isfinite(gap)]  # a NaN twin is no evidence of noise
        total += float(gap.max()) if gap.size else 0.0
    return total


class TwinEnvelope(ComparisonDefaults):
    method: Method = "twin"
    all_controls = True  # the control, then its noise twins
    calibrated = True  # its parameters come from the calibration in force (calibration/)
    anchored_twins = True

    def one_step_tolerance(
        self, rule: ComparisonRule, controls: Sequence[Curve], anchored_twins: Sequence[Curve]
    ) -> Tolerance | None:
        """From the twins' own steps from the anchors when they ran (AnchoredTwinTolerance),
        else the twin envelope of step 1."""
        if anchored_twins and controls:
            floor = paired_tolerance(dataclasses.replace(rule, method="paired"))
            return AnchoredTwinTolerance(
                k=ONE_STEP_K if rule.z is None else rule.z,
                relative_noise=relative_one_step_noise(controls[0], anchored_twins),
                floor=dataclasses.replace(floor, growth=0.0, atol=floor.atol * (1 + floor.growth)),
            )
        if len(controls) > 1:
            return twin_tolerance(rule, controls[0], controls[1:])
        return None

    def monitor(self, rule: ComparisonRule, controls: Sequence[Curve]) -> Check | None:
        if len(controls) < 2:
            return None  # no twin, no envelope: the final verdict says so
        # The control and its twin finished before the test started: the envelope is whole.
        return point_check(
            controls[0], tolerance_at(twin_tolerance(rule, controls[0], controls[1:]))
        )

    def compare(
        self, rule: ComparisonRule, controls: Sequence[Curve], test: Curve
    ) -> MetricVerdict:
        """``controls`` = (control, twin, ...): the control first, then its noise twins."""
        if len(controls) < 2 and rule.metric != "lr":
            return failed(
                rule,
                self.method,
                "the twin regime needs the control and its twin "
                "run; only the control logged this metric",
            )
        tol = twin_tolerance(rule, controls[0], controls[1:])
        verdict = envelope_verdict(
            rule, self.method, controls[:1], test, tol, band="the twin envelope"
        )
        # The band (what the test had to stay in, per step) is the verdict's own, as for
        # paired; the details say how it was sized.
        verdict.details.update(
            {"k": tol.k, "twin_noise_max": float(tol.noise[-1]) if tol.noise.size else 0.0}
        )
        return verdict

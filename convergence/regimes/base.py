"""The Regime Protocol: how a pair is judged -- one strategy per regime (paired, twin, seed).

A regime decides which control jobs a pair runs besides its control (a noise twin, seed
replicates), which checks the pair must pass before anything is launched, which comparison
method judges its gating metrics, how its test may be stopped early and whether a failure is
worth the numerics probe. Each regime is one module of this package; ``registry.py`` names them.

This package sits just above ``convergence.spec`` and ``convergence.metrics`` (the layer test,
tests/test_layers.py): it imports no backend, statistics or runner. What it needs from a
backend -- the control's noise twin -- it takes as a :class:`TwinSource` argument, which every
``convergence.backends.Backend`` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from convergence.metrics.curve import RunMetrics
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import ComparisonRule, Method, PairSpec
from convergence.spec.rules import DATA_RULE, PERFORMANCE_RULES


class TwinSource(Protocol):
    """The part of a backend a regime may ask for (convergence.backends.base.Backend)."""

    def noise_twin(self, job: JobSpec) -> JobSpec | None:
        """A job that differs from ``job`` only by legitimate numerical noise; None: none."""
        ...


#: Optional on a TwinSource (``getattr``): ``forward_twin(job, *, tp=2) -> JobSpec | None``, the
#: job rounding its forward as TP of degree ``tp`` does (convergence.backends.base.Backend.
#: forward_twin).
FORWARD_TWIN = "forward_twin"


#: Optional on a Regime (``getattr``): ``resumed_controls(pair, backend) -> tuple[JobSpec, ...]``,
#: the control-side jobs that a resuming test's checkpoint is also loaded into, to size the
#: verdict after the resume from that shared state (convergence/regimes/twin.py: the twins).
#: A regime without it judges a resumed curve like any other (:func:`resumed_controls`).
RESUMED_CONTROLS = "resumed_controls"


def resumed_controls(regime: Regime, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
    """The regime's jobs to run from a resuming test's checkpoint to the end (() for none,
    or when the test does not resume)."""
    method = getattr(regime, RESUMED_CONTROLS, None)
    if pair.test.resume is None or method is None:
        return ()
    jobs: tuple[JobSpec, ...] = method(pair, backend)
    return jobs


@dataclass(frozen=True, kw_only=True)
class EarlyStopPolicy:
    """When the sequential monitor (convergence.stats.sequential) may stop a test job.

    A failure is decided once a gating metric stays clearly outside its tolerance for
    ``patience`` consecutive logged steps, counted from ``min_step`` on (the first optimizer
    steps are the noisiest and least informative); a pass is never decided early.
    """

    min_step: int = 5
    patience: int = 3


#: The policy every shipped regime uses (measured on the detection catalogues, BENCHMARKS.md).
DEFAULT_EARLY_STOP = EarlyStopPolicy()


@dataclass(frozen=True, kw_only=True)
class ControlCurves:
    """What travels with the control's outcome besides its own curves (for verdicts and reports):
    the seed band's replicates (including the control), or the twins' curves."""

    replicates: tuple[RunMetrics, ...] = ()
    twins: tuple[RunMetrics, ...] = ()
    """Twin regime: every twin's curves (noise twin first), in ``control_jobs`` order."""


class Regime(Protocol):
    """One way of judging a pair. Implementations are frozen and hold no state."""

    # Read-only attributes (properties here, so that frozen dataclasses satisfy them).
    @property
    def name(self) -> str:
        """As written in experiment files (``regime = "..."``), reports and ``--regime``."""
        ...

    @property
    def method(self) -> Method:
        """The comparison method of its gating metrics (convergence.stats.registry)."""
        ...

    @property
    def early_stop(self) -> EarlyStopPolicy:
        """When its test job may be stopped early."""
        ...

    @property
    def band_of_replicates(self) -> bool:
        """Whether its method's verdicts hold the test to a band of control replicates
        (reports draw it centred on their mean, with the replicates' count)."""
        ...

    @property
    def probe_on_failure(self) -> bool:
        """Whether a failed pair is localised by the numerics probe: both sides must start
        from one seed checkpoint and read the same samples for a per-module comparison to
        mean much."""
        ...

    def default_rules(self) -> tuple[ComparisonRule, ...]:
        """The rules of a pair whose experiment names none (``compare`` overrides them)."""
        ...

    def claims(self, control: JobSpec, test: JobSpec, *, twins: bool) -> bool:
        """Whether this regime is the default for these jobs (asked in registry order);
        ``twins``: both sides' backends derive noise twins for the usual controls
        (convergence.backends.Capabilities.twins_by_default)."""
        ...

    def check(self, pair: PairSpec, *, key: str, backend: TwinSource) -> None:
        """Preflight of a pair of this regime (``backend``: the control's); raises SpecError."""
        ...

    def check_method_use(self, pair: PairSpec, *, key: str) -> None:
        """Raise SpecError when a rule of ``pair`` (any regime) uses this regime's method where
        it cannot work (the method needs controls only this regime runs)."""
        ...

    def control_jobs(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        """Every control job the pair runs, ``pair.control`` first."""
        ...

    def check_control_runs(self, count: int) -> None:
        """``convergence compare``: raise SpecError when ``count`` control runs (A and each
        --replicate) cannot give this regime's verdict."""
        ...

    def control_curves(self, runs: Sequence[RunMetrics]) -> ControlCurves:
        """From the control runs (in ``control_jobs`` order) to what the outcome keeps."""
        ...


def gating_rules(method: Method, *, update: bool = True) -> tuple[ComparisonRule, ...]:
    """Loss and grad norm judged by ``method`` (a wrongly scaled gradient can leave an Adam
    loss almost unchanged but doubles the grad norm), the per-part grad norm (a bug in one kind
    of weight -- queries and keys under a position bug -- hides in the total), the per-part
    update norm (``update``: what the optimizer applied after clipping -- a clipping bug, a
    wrong LR, a lost optimizer state show there first; judged where both sides start from the
    same state and data, not across seeds), the data fingerprint, plus throughput and memory:
    the default rules of every shipped regime."""
    applied = (ComparisonRule(metric="update_norm_parts", method=method),) if update else ()
    return (
        (
            ComparisonRule(metric="loss", method=method),
            ComparisonRule(metric="grad_norm", method=method),
            ComparisonRule(metric="grad_norm_parts", method=method),
        )
        + applied
        + (DATA_RULE,)
        + PERFORMANCE_RULES
    )


def check_replicates(pair: PairSpec, regime: str, *, what: str, fix: str) -> None:
    """SpecError unless ``pair`` asks for at least 2 replicates (a band needs two runs)."""
    if pair.replicates < 2:
        raise SpecError(
            f"the {regime} regime needs at least 2 {what}",
            file=pair.source,
            key="replicates",
            fix=fix,
        )


@dataclass(frozen=True)
class ShippedRegime:
    """What the shipped regimes have alike (a subclass gives ``name`` and ``method`` defaults
    and overrides what differs): the shared gating rules judged by its own method, one control
    job, nothing kept beside the control's curves, every method use allowed. A regime of
    another package may start from it too; the :class:`Regime` Protocol is what counts."""

    name: str
    method: Method
    band_of_replicates: bool = False
    early_stop: EarlyStopPolicy = DEFAULT_EARLY_STOP
    probe_on_failure: bool = True

    def default_rules(self) -> tuple[ComparisonRule, ...]:
        return gating_rules(self.method)

    method_needs: str = ""
    """Why this regime's method works only under this regime (it needs controls only this
    regime runs), for the error; empty: the method may be used under any regime."""

    def check_method_use(self, pair: PairSpec, *, key: str) -> None:
        metrics = [r.metric for r in pair.rules if r.method == self.method]
        if self.method_needs and metrics and pair.regime != self.name:
            raise SpecError(
                f'compare.{metrics[0]} = "{self.method}" needs the {self.name} regime '
                f"({self.method_needs})",
                file=pair.source,
                key=f"{key}.compare.{metrics[0]}",
                fix=f'set regime = "{self.name}", or another method for this metric',
            )

    def control_jobs(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        return (pair.control,)

    def check_control_runs(self, count: int) -> None:
        return None  # the first run is the control; others are not used

    def control_curves(self, runs: Sequence[RunMetrics]) -> ControlCurves:
        return ControlCurves()

"""A control/test pair and the rules that compare their metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec

#: Metric names used throughout the library (backends map their own tags onto these).
METRICS: tuple[str, ...] = (
    "loss",
    "grad_norm",
    "grad_norm_parts",
    "update_norm",
    "update_norm_parts",
    "lr",
    "val_loss",
    "tokens_per_s",
    "peak_mem_mib",
    "data_fingerprint",
    # MoE models (built-in trainer, docs/moe.md): logged every step, compared only when a
    # pair's `compare` table names them (a legitimate routing flip changes the fingerprint).
    "routing_fingerprint",
    "moe_aux_loss",
)
#: The comparison methods (convergence.stats.registry implements each).
Method = Literal["exact", "allclose", "paired", "twin", "seed", "regression", "margin"]
METHODS: tuple[Method, ...] = get_args(Method)
Tier = Literal["quick", "ci", "nightly"]
"""Which runs select a pair, cheapest first (experiment key ``tier``)."""
#: Regimes are not a closed list: convergence.regimes registers them (paired: bitwise-comparable
#: fp32 runs at the noise floor; twin: same seed checkpoint and data but not bitwise
#: reproducible, a noise envelope measured on a twin of the control; seed: different seeds, a
#: band of control replicates), and a pair's regime is checked against that registry by
#: convergence.preflight.


@dataclass(frozen=True, kw_only=True)
class ComparisonRule:
    """How one metric of the test is judged against the control.

    ``None`` parameters mean "the method's calibrated default" (see convergence.stats).
    """

    metric: str
    """One of :data:`METRICS`."""
    method: Method
    """``exact`` | ``allclose`` | ``paired`` | ``twin`` | ``seed`` | ``regression`` |
    ``margin``."""
    gate: bool = True
    """Whether a failure of this metric fails the pair (throughput/memory default to False)."""
    rtol: float | None = None
    """allclose: relative tolerance."""
    atol: float | None = None
    """allclose: absolute tolerance; paired: the noise floor at step 1."""
    growth: float | None = None
    """paired: how the tolerance grows with the step (multiplier of sqrt(step))."""
    z: float | None = None
    """seed: band half-width in standard deviations; twin: multiplier k of the measured noise."""
    alpha: float | None = None
    """seed: level of the equivalence test (TOST) on the final window; margin: level of the
    non-inferiority test in each window."""
    margin: float | None = None
    """seed: equivalence margin for the final-window mean difference; margin: how much worse
    the test may be (metric units, nats for the loss; default: 2 seed std's of the control)."""
    window: int | None = None
    """seed: length of the final window (logged steps)."""
    max_regression: float | None = None
    """regression: allowed relative loss of the metric (0.1 = 10% slower / bigger)."""
    explicit: bool = False
    """Named in the experiment's ``compare`` table (not a default): a run that does not log
    the metric is then an error of the pair, not a "not compared" note."""

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise SpecError(
                f"unknown metric {self.metric!r}",
                key=f"compare.{self.metric}",
                fix=f"use one of {', '.join(METRICS)}",
            )
        if self.method not in METHODS:
            raise SpecError(
                f"unknown comparison {self.method!r}",
                key=f"compare.{self.metric}",
                fix=f"use one of {', '.join(METHODS)}",
            )


@dataclass(frozen=True, kw_only=True)
class PairSpec:
    """A control job and a test job that must agree under ``rules``."""

    pair_id: str
    """Stable id, e.g. ``converging.toml::fsdp2-tp2`` (the pytest item name)."""
    control: JobSpec
    test: JobSpec
    rules: tuple[ComparisonRule, ...]
    regime: str = "paired"
    """A registered regime (convergence.regimes): ``paired`` (same seed checkpoint and data,
    bitwise-comparable), ``twin`` (same seed checkpoint and data, noise envelope from a twin
    of the control) or ``seed`` (ensemble)."""
    replicates: int = 3
    """seed regime: number of control replicates (different seeds) forming the band. Here,
    not in the seed regime, because the pair is parsed in spec/, the bottom layer, which
    cannot import the regimes, and a pair must stay one frozen, serialisable value (saved
    outcomes, the run cache); only convergence.regimes.seed reads it."""
    early_stop: bool = True
    """Stop the test job once the verdict is decided."""
    source: str = ""
    tier: Tier = "quick"
    """Which runs select it: ``quick`` (default ``-m convergence``), ``ci``, ``nightly``."""
    probe_on_failure: bool = True
    """Run the per-module numerics probe on both sides when a paired pair fails."""
    probe_always: bool = False
    """Run the numerics probe on both sides whatever the verdict (experiment key
    ``probe = "always"``): the per-module table lands in the report."""
    golden: str | None = None
    """Optional golden curve file to compare the test against instead of a control run."""
    check_keys: tuple[tuple[str, Any], ...] = ()
    """The pair keys a check owns (convergence/checks: ``Check.keys``, e.g. the anchored
    check's ``anchor_every``), as the experiment wrote them; a key the experiment left out is
    absent (the check decides what that means: automatic anchors on a long pair). Kept raw
    here because spec/ sits below the checks: each check parses and refuses its own values at
    collection (``Check.validate``), so adding a check adds no field, key list or parser here."""
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    placement: str = ""
    """Where the pair's jobs run, as decided at collection (convergence.launch.placement:
    ``cuda: ...``, ``cuda-shared: ...``, ``cpu: ...``); empty until placed."""

    @property
    def name(self) -> str:
        return self.pair_id.split("::")[-1]

    def check_key(self, name: str) -> Any:
        """The value of a check's pair key, None where the experiment left it out."""
        return dict(self.check_keys).get(name)

    def rule_for(self, metric: str) -> ComparisonRule | None:
        for rule in self.rules:
            if rule.metric == metric:
                return rule
        return None

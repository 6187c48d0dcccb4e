"""A check: evidence about a pair beyond its rules' comparison of the two curves -- the
anchored check (one step from the control's states), the resumed check (the steps after a
test's resume, against twins resumed from the same checkpoint), and whatever a third-party
package adds under the entry-point group ``convergence.checks`` (convergence/checks/registry.py).

A check *describes*; the Runner (convergence/run/runner.py) *does*, the same way for every
check. It owns its pair keys (:attr:`Check.keys`: the anchored check's ``anchor_every``), kept
raw on the pair (``PairSpec.check_keys``) and parsed by :meth:`Check.validate` at collection.
For a pair the check applies to (:meth:`Check.applies`: the anchored check also by itself, on
a long pair), it says:

- what it refuses at collection (:meth:`Check.refuse`: a SpecError naming file, key, fix);
- how it changes the regime's control jobs (:meth:`Check.control_jobs`: e.g. save anchors);
- the extra jobs it needs once the control group and the test ran (:meth:`Check.extra_jobs`);
- its verdicts from all of that (:meth:`Check.verdicts`, made inside the one judge,
  convergence/run/judge.py, under the pair's calibration), and which of the verdicts before
  it no longer gate because it judges them better;
- where a failure is localised (:meth:`Check.probe`: the numerics probe from a checkpoint of
  its own, instead of a replay of the run from step 1) and whether the replay can work at all
  (:attr:`Check.replay_probe`).

Why "describe": the checks sit below the Runner and above the backends (tests/test_layers.py),
so preflight can ask them at collection and the Runner can run what they ask for, and adding a
check is one module here, its statistics (convergence/stats/), its trainer side and a registry
line -- not a branch in the Runner, preflight and the judge each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from convergence.backends.base import Backend
from convergence.metrics.curve import RunMetrics
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.stats.types import MetricVerdict


@dataclass(frozen=True)
class SideRun:
    """One job as it ran (or came from the cache), as a check sees it."""

    job: JobSpec
    metrics: RunMetrics
    run_dir: Path | None = None
    metrics_path: Path | None = None
    """The metrics file the launcher read (None: the run folder's dump/metrics.jsonl)."""
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExtraJob:
    """A job a check needs beside the pair's control group and test."""

    role: str
    """The check's name for it (its verdicts find the run by it)."""
    side: Literal["control", "test"]
    """Whose it is: the run folder's prefix and the device pool's side."""
    job: JobSpec
    cacheable: bool
    """Control-side jobs that start from the control's own state are shared through the run
    cache; what starts from the test's state is part of what is under test: never cached."""


@dataclass(frozen=True)
class Ran:
    """What a pair ran, handed to a check: the control group (the control first, then the
    regime's other control jobs), the test, and the check's extra jobs by role (empty before
    they ran, or where the check asked for none)."""

    controls: tuple[SideRun, ...]
    test: SideRun
    extra: Mapping[str, Mapping[str, tuple[SideRun, ...]]] = field(default_factory=dict)
    """Each check's extra jobs as they ran: check name -> role -> runs."""
    upto: int | None = None
    """The last step the test ran when it was stopped early (None: it ran to the end)."""

    def of(self, check: str, role: str) -> tuple[SideRun, ...]:
        """Check ``check``'s extra jobs of ``role`` as they ran (() where none ran)."""
        return tuple(self.extra.get(check, {}).get(role, ()))


@dataclass(frozen=True)
class ProbeRequest:
    """The numerics probe of ``step`` on both layouts, each loading ``checkpoint``
    (convergence/run/probe.py ``probe_from_checkpoint``)."""

    control: JobSpec
    test: JobSpec
    checkpoint: Path
    folder: str
    """Its folder under the pair's ``probe/``."""
    step: int
    head: Mapping[str, Any]
    failed: str


class Check(Protocol):
    name: str
    """Its verdict's metric name (report.json, JUnit, the matrix) and its registry name."""

    replay_probe: bool
    """False where the default probe -- replaying both layouts from step 1 -- cannot stand
    for this pair (a resuming test: the replay cannot resume); then only :meth:`probe` can
    localise its failure."""

    keys: Mapping[str, str]
    """The pair keys it owns (experiment files, the marker), each with its entry in the
    documentation's key table; {} for none."""

    def validate(self, pair: PairSpec, *, key: str, steps: int | None) -> None:
        """Raise SpecError (file, key, fix) for a bad value of its keys on ``pair`` (called at
        collection for every pair; ``key``: the test's key in the experiment file),
        ``steps``: the session's --convergence-steps where the pair will run (else None)."""
        ...

    def applies(self, pair: PairSpec) -> bool:
        """Whether the pair (as it runs: after the session's settings) has this check."""
        ...

    def trajectory_until(self, pair: PairSpec) -> int | None:
        """The last step at which the trajectories gate where this check runs (None: every
        step): the early-stop monitor stops a test only on what the verdict would fail."""
        ...

    def refuse(self, pair: PairSpec, backends: Mapping[str, Backend], *, key: str) -> None:
        """Raise SpecError (file, key, fix) when the check cannot run on this pair; called at
        collection for a pair it applies to. ``backends``: "control" and ``key`` (the test's
        key in the experiment file)."""
        ...

    def control_jobs(self, pair: PairSpec, jobs: Sequence[JobSpec]) -> tuple[JobSpec, ...]:
        """The regime's control jobs as this check needs them run (the control first)."""
        ...

    def extra_jobs(self, pair: PairSpec, ran: Ran, backend: Backend) -> tuple[ExtraJob, ...]:
        """The jobs it needs once the control group and the test ran (``backend``: the
        control's); SpecError where what they start from is missing."""
        ...

    def verdicts(
        self, pair: PairSpec, ran: Ran, verdicts: tuple[MetricVerdict, ...]
    ) -> tuple[MetricVerdict, ...]:
        """``verdicts`` (the rules' and the checks' before this one) with this check's added,
        under the judge's calibration; ``verdicts`` as they are where its jobs did not run.
        A check may also take a verdict it supersedes out of the gate, saying so in its
        message (the anchored check: a trajectory's failure past its first steps)."""
        ...

    def probe(
        self, pair: PairSpec, verdicts: Sequence[MetricVerdict], ran: Ran
    ) -> ProbeRequest | None:
        """Where to probe a failed pair from, when this check knows better than a replay."""
        ...


def first_divergent_step(verdicts: Sequence[MetricVerdict]) -> int | None:
    """Earliest first-divergent step over the failing gate verdicts (None when none says)."""
    steps = [
        v.first_divergent_step
        for v in verdicts
        if v.gate and not v.passed and v.first_divergent_step is not None
    ]
    return min(steps) if steps else None

"""The pair level: runs a pair end to end on the job level (run/jobs.py) and judges it.

    PairSpec -> controls (golden, or the regime's control jobs, cached) -> test (watched by
    the early-stop monitor) -> verdicts (with the session's noise floors) -> numerics probe on
    failure -> PairOutcome

Nothing here knows about pytest. The plugin and the CLI hold one Runner per session
(:class:`convergence.run.session.SessionRunner`) and call :meth:`Runner.run_pair` for each pair.
A Runner holds the session's :class:`~convergence.run.jobs.JobRunner` (launcher, device pool,
run cache, the public job API) and runs each pair on a view of it that reports to the pair's
printer (``JobRunner.reporting_to``); modules that only run jobs (the probe, ``convergence ab``)
use the job level and never import this module.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from convergence.calibration.select import select_calibration
from convergence.checks import Check, ExtraJob, Ran, SideRun, checks_of
from convergence.checks.base import first_divergent_step
from convergence.launch.fork_servers import ForkServers
from convergence.launch.pool import PoolTooSmall
from convergence.launch.types import Launcher, Progress
from convergence.metrics.curve import RunMetrics
from convergence.metrics.reader import read_run
from convergence.regimes import Regime, get_regime
from convergence.run.jobs import JobFailed, JobRunner, RunSettings, apply_job_settings, slug
from convergence.run.judge import judge
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.run.probe import localise, probe_from_checkpoint, wants_probe
from convergence.run.resume import run_resumed
from convergence.run.settle import settle
from convergence.run.together import run_together
from convergence.spec.errors import RunFailed, SpecError
from convergence.spec.pair import PairSpec
from convergence.stats.health import control_problem
from convergence.stats.registry import get_comparison
from convergence.stats.sequential import SequentialMonitor
from convergence.stats.types import MetricVerdict

# Re-exported: the settings and the job failure are part of the Runner's API.
__all__ = ["JobFailed", "Runner", "RunSettings", "apply_settings"]


def apply_settings(pair: PairSpec, settings: RunSettings) -> PairSpec:
    """Session overrides (steps, backend, alpha) applied to a pair's jobs and rules."""
    rules = pair.rules
    if settings.alpha is not None:
        rules = tuple(
            dataclasses.replace(r, alpha=settings.alpha)
            if get_comparison(r.method).takes_alpha
            else r
            for r in rules
        )
    return dataclasses.replace(
        pair,
        control=apply_job_settings(pair.control, settings),
        test=apply_job_settings(pair.test, settings),
        rules=rules,
    )


class Runner:
    """The pair level: runs pairs one at a time on the session's job level (a pair's
    control-side jobs at once, as the pool has room) and judges them.

    Build it once per session, like the JobRunner it holds (see there for the cost).
    """

    def __init__(
        self,
        settings: RunSettings,
        *,
        launcher: Launcher | None = None,
        fork_servers: ForkServers | None = None,
    ) -> None:
        self.settings = settings
        self.jobs = JobRunner(settings, launcher=launcher, fork_servers=fork_servers)
        # The calibration this session's verdicts use: the file for this stack, else the
        # shipped defaults (convergence/calibration/select.py); every verdict names it, and
        # the early-stop monitor is handed it too.
        self.calibration = select_calibration(settings.work_dir)

    # -- pairs --------------------------------------------------------------------------
    def run_pair(
        self, pair: PairSpec, *, on_progress: Callable[[Progress], None] | None = None
    ) -> PairOutcome:
        """Run ``pair`` and judge it. A run failure (:class:`RunFailed`: a job, the cache)
        becomes status "error", never raised.

        ``on_progress``: where this pair's progress goes (default ``settings.on_progress``);
        the plugin gives each test item its own printer while the Runner lives on.
        """
        try:
            return self._run_pair(pair, self.jobs.reporting_to(on_progress))
        except (RunFailed, PoolTooSmall) as exc:
            # A run failure past _run_pair's own handling, or a job larger than the pool (the
            # plugin's preflight says so first; a library caller meets it here): not a bug.
            return PairOutcome(pair=pair, status="error", control=None, test=None, error=str(exc))
        except Exception as exc:  # noqa: BLE001 -- a bug of ours: still in the report, as an error
            return self._internal_error(pair, exc)

    def _internal_error(self, pair: PairSpec, exc: Exception) -> PairOutcome:
        """An unexpected exception (not a job failure, a bug in this package) as an error
        outcome: the session's report, saved outcomes and JUnit still list the pair, and
        the traceback is kept in the pair's run folder."""
        text = "".join(traceback.format_exception(exc))
        where = self.settings.work_dir / "runs" / slug(pair.pair_id) / "internal_error.txt"
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(text)
            kept = f"traceback in {where}"
        except OSError:
            kept = "traceback:\n" + text
        return PairOutcome(
            pair=pair,
            status="error",
            control=None,
            test=None,
            error=f"internal error in pytest-convergence (a bug: please report "
            f"it): {type(exc).__name__}: {exc}; {kept}",
        )

    def _run_pair(self, pair: PairSpec, jobs: JobRunner) -> PairOutcome:
        """``pair`` run on ``jobs`` (the job level, reporting to this pair's printer)."""
        started = time.monotonic()
        # The session's settings, then what the checks set by themselves on the steps that
        # run (the automatic anchored check of a long pair).
        pair = apply_settings(pair, self.settings)
        pair_dir = self.settings.work_dir / "runs" / slug(pair.pair_id)
        checks = checks_of(pair)
        control: SideOutcome | None = None
        test: SideOutcome | None = None
        extra: dict[str, dict[str, tuple[SideOutcome, ...]]] = {}
        try:
            regime = get_regime(pair.regime)
            controls = self._controls(pair, pair_dir, regime=regime, jobs=jobs, checks=checks)
            control = controls[0]
            unhealthy = None if pair.golden else _control_problem(control)
            if unhealthy:
                return _error(pair, control, None, unhealthy, started)
            control_runs = [c.metrics for c in controls]
            test = self._test(pair, pair_dir, regime, control_runs, jobs, checks)
            for check in checks:  # each check's extra jobs, once the control group and test ran
                asked = check.extra_jobs(pair, _ran(controls, test), jobs.backend(pair.control))
                extra[check.name] = _run_extra(jobs, asked, pair_dir=pair_dir)
        except (RunFailed, SpecError) as exc:
            # RunFailed: a job or the cache failed (JobFailed, CacheError). SpecError: input
            # found wrong only now, after the session's settings (e.g. --convergence-steps
            # cutting a run before its resume step); either way this pair is an error.
            return _error(pair, control, test, str(exc), started)
        except OSError as exc:  # our own writes (run folder, logs, metrics): e.g. disk full
            return _error(pair, control, test, _os_error_text(exc, self.settings.work_dir), started)
        stopped = _stopped_at(test)  # a test stopped early is judged on the steps it ran
        ran = _ran(controls, test, extra, upto=stopped)
        verdicts = judge(
            pair,
            control_runs,
            test.metrics,
            self.calibration,
            test_meta=test.meta,
            upto=stopped,
            ran=ran,
        ).verdicts
        settled = settle(
            pair, verdicts, control.metrics, twins=control.twins, test_result=test.result
        )
        localisation = self._localise(pair, settled.status, pair_dir, verdicts, ran, checks, jobs)
        return PairOutcome(
            pair=pair,
            status=settled.status,
            control=control,
            error=settled.error,
            localisation=localisation,
            test=dataclasses.replace(test, replicates=()),
            verdicts=tuple(verdicts),
            stopped_early_at=stopped,
            wall_s=time.monotonic() - started,
            extra_sides=tuple(
                side for roles in extra.values() for runs in roles.values() for side in runs
            ),
        )

    def _test(
        self,
        pair: PairSpec,
        pair_dir: Path,
        regime: Regime,
        control_runs: Sequence[RunMetrics],
        jobs: JobRunner,
        checks: Sequence[Check],
    ) -> SideOutcome:
        """The test side, watched by the early-stop monitor where the pair stops early (on
        the steps whose trajectories the verdict gates: the checks say until when)."""
        on_metrics = None
        if pair.early_stop and self.settings.early_stop:
            policy = regime.early_stop
            until = [u for c in checks if (u := c.trajectory_until(pair)) is not None]
            # The launcher feeds each record to the monitor itself (no callback of ours
            # between them): it says when the test's failure is decided.
            on_metrics = SequentialMonitor(
                pair.rules,
                control_runs,
                key_map=jobs.backend(pair.test).record_keys(pair.test),
                calibration=self.calibration,
                last_step=min(until, default=None),
                min_step=policy.min_step,
                patience=policy.patience,
            ).decided_by
        if pair.test.resume is not None:  # two jobs, one curve (run/resume.py)
            return run_resumed(jobs, "test", pair.test, pair_dir=pair_dir, on_metrics=on_metrics)
        return jobs.run_job(
            "test", pair.test, pair_dir=pair_dir, cacheable=False, on_metrics=on_metrics
        )

    # -- numerics probe (failure localisation; see convergence.run.probe) ----------------
    def _localise(
        self,
        pair: PairSpec,
        status: str,
        pair_dir: Path,
        verdicts: Sequence[MetricVerdict],
        ran: Ran,
        checks: Sequence[Check],
        jobs: JobRunner,
    ) -> dict[str, Any] | None:
        """Probe both sides of a failed paired pair (or a ``probe = "always"`` pair): from
        where a check says (the failing anchor, the test's checkpoint), else by replaying both
        layouts from step 1 -- at step 1, and at the first divergent step when step 1 shows
        nothing -- where every check of the pair allows the replay."""
        if not wants_probe(pair, status):
            return None
        if any(v.metric == "data_fingerprint" and v.gate and not v.passed for v in verdicts):
            return None  # the sides read different data: a numerics probe has nothing to add
        for check in checks:
            request = check.probe(pair, verdicts, ran)
            if request is not None:
                return probe_from_checkpoint(
                    jobs,
                    request.control,
                    request.test,
                    request.checkpoint,
                    pair_dir / "probe" / request.folder,
                    step=request.step,
                    head=request.head,
                    failed=request.failed,
                )
        if not all(check.replay_probe for check in checks):
            return None
        runs = (ran.controls[0].metrics, ran.test.metrics)
        return localise(
            pair, pair_dir, runner=jobs, divergent_step=first_divergent_step(verdicts), runs=runs
        )

    def _controls(
        self,
        pair: PairSpec,
        pair_dir: Path,
        regime: Regime,
        jobs: JobRunner,
        checks: Sequence[Check] | None = None,
    ) -> list[SideOutcome]:
        """The control sides, ``pair.control`` first (``regime``: the pair's), run on ``jobs``."""
        if pair.golden:
            golden = read_run(Path(pair.golden), key="golden")
            return [
                SideOutcome(
                    job=pair.control, metrics=golden, cached=True, run_dir=Path(pair.golden).parent
                )
            ]
        # The regime's control jobs: the control, and its twin or seed replicates.
        specs = regime.control_jobs(pair, jobs.backend(pair.control))
        for check in checks_of(pair) if checks is None else checks:  # e.g. anchor saves
            specs = check.control_jobs(pair, specs)
        # Independent of each other: at once where the pool has room (run/together.py).
        sides = run_together(
            [
                partial(jobs.run_job, "control", spec, pair_dir=pair_dir, cacheable=True)
                for spec in specs
            ],
            together=self.settings.concurrent_controls,
        )
        # What travels with the control (seed replicates, the twin's curves) is the regime's.
        kept = regime.control_curves([s.metrics for s in sides])
        sides[0] = dataclasses.replace(sides[0], replicates=kept.replicates, twins=kept.twins)
        return sides


def _control_problem(control: SideOutcome) -> str | None:
    """A control that did not learn or undercut the entropy floor is no reference (stats.health)."""
    floor = (control.meta or {}).get("entropy_floor")
    problem = control_problem(
        control.metrics.get("loss"),
        float(floor) if isinstance(floor, (int, float)) else None,
        control.metrics.get("update_norm"),
    )
    return f"control job {control.job.name!r}: {problem}" if problem else None


def _error(
    pair: PairSpec,
    control: SideOutcome | None,
    test: SideOutcome | None,
    error: str,
    started: float,
) -> PairOutcome:
    """The pair as an error before its verdict, with what ran of it."""
    return PairOutcome(
        pair=pair,
        status="error",
        control=control,
        test=test,
        error=error,
        wall_s=time.monotonic() - started,
    )


def _side_run(side: SideOutcome) -> SideRun:
    metrics_path = side.result.metrics_path if side.result is not None else None
    return SideRun(
        job=side.job,
        metrics=side.metrics,
        run_dir=side.run_dir,
        metrics_path=metrics_path,
        meta=side.meta,
    )


def _ran(
    controls: Sequence[SideOutcome],
    test: SideOutcome,
    extra: Mapping[str, Mapping[str, Sequence[SideOutcome]]] | None = None,
    *,
    upto: int | None = None,
) -> Ran:
    """What the pair ran, as its checks see it."""
    return Ran(
        controls=tuple(_side_run(c) for c in controls),
        test=_side_run(test),
        extra={
            check: {role: tuple(_side_run(s) for s in sides) for role, sides in roles.items()}
            for check, roles in (extra or {}).items()
        },
        upto=upto,
    )


def _run_extra(
    jobs: JobRunner, asked: Sequence[ExtraJob], *, pair_dir: Path
) -> dict[str, tuple[SideOutcome, ...]]:
    """A check's extra jobs by role: the test's one after another (each a test layout's
    devices), the control-side ones at once where the pool has room (run/together.py)."""
    out: dict[str, list[SideOutcome]] = {}
    for extra in (e for e in asked if e.side == "test"):
        side = jobs.run_job("test", extra.job, pair_dir=pair_dir, cacheable=extra.cacheable)
        out.setdefault(extra.role, []).append(side)
    control_side = [e for e in asked if e.side == "control"]
    sides = run_together(
        [
            partial(jobs.run_job, "control", e.job, pair_dir=pair_dir, cacheable=e.cacheable)
            for e in control_side
        ],
        together=jobs.settings.concurrent_controls,
    )
    for extra, side in zip(control_side, sides, strict=True):
        out.setdefault(extra.role, []).append(side)
    return {role: tuple(sides) for role, sides in out.items()}


def _os_error_text(exc: OSError, work_dir: Path) -> str:
    import errno

    if exc.errno == errno.ENOSPC:
        return (
            f"disk full while writing {exc.filename or 'a run file'} ({exc}); free space "
            f"in {work_dir} or move it elsewhere (--convergence-workdir DIR)"
        )
    return f"I/O error: {exc} (work folder {work_dir})"


def _stopped_at(test: SideOutcome) -> int | None:
    """Last step of a test job that was stopped early (None when it ran to the end)."""
    if test.result is None or test.result.status != "stopped_early":
        return None
    # The trainer finishes the step it is in after the stop request: its metrics may hold a
    # step more than the launcher saw.
    loss = test.metrics.get("loss")
    if loss is not None and len(loss):
        return int(loss.steps[-1])
    return test.result.last_step

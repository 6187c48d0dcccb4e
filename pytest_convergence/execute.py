"""Run one pair for a pytest test (TOML item or ``convergence_pair`` fixture) and record it."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

from convergence.run.outcome import PairOutcome
from convergence.spec.pair import PairSpec
from pytest_convergence.failure_section import ConvergenceFailure
from pytest_convergence.progress import ProgressPrinter
from pytest_convergence.progress_relay import WorkerProgress
from pytest_convergence.stash import SessionState, get_state

OUTCOME_SUFFIX = ".outcome.json"


def execute_pair(
    config: pytest.Config, pair: PairSpec, user_properties: list[tuple[str, object]]
) -> PairOutcome:
    """Run ``pair`` with live progress, record its outcome for the reports, and attach its
    JUnit properties. KeyboardInterrupt passes through: the launcher ends the job trees."""
    # Other plugins changed the pair (or vetoed it) before its checks, at collection or in
    # the fixture (collection.modified_pair): ``pair`` is the checked pair to run.
    state = get_state(config)
    _ignore_in_git(state.settings.work_dir)
    printer: ProgressPrinter | WorkerProgress | None = ProgressPrinter(config)
    if state.is_worker:  # its terminal is not the user's: the controller relays a file
        printer = WorkerProgress(state.share_dir) if state.share_dir is not None else None
    outcome: PairOutcome | None = None
    try:
        outcome = state.runner.run_pair(pair, on_progress=printer)
        from convergence.run.attribution import attribute_failed, attribution_on  # lazy

        if attribution_on(asked=bool(state.options["attribute"]), tier=state.options["tier"]):
            outcome = attribute_failed(
                outcome,
                run=lambda sub: state.runner.run_pair(sub, on_progress=printer),
                devices=state.device_set(),
                device_mode=state.options["device"],
            )
    except KeyboardInterrupt as exc:
        if outcome is not None:  # interrupted while attributing: the pair's verdict stands
            record_outcome(config, outcome, user_properties)
            raise
        # Ctrl-C / SIGTERM mid-pair: the report still lists the pair (as an error that says
        # so), not only the pairs that had finished. Runs that finished (e.g. the control)
        # are already in the run cache and are reused by the next session.
        reason = str(exc) or "Ctrl-C"
        record_outcome(
            config,
            PairOutcome(
                pair=pair,
                status="error",
                control=None,
                test=None,
                error=f"interrupted ({reason}) before the pair finished; its finished runs are "
                "in the run cache and the next session reuses them",
            ),
            user_properties,
        )
        raise
    finally:
        if printer is not None:
            printer.finish()
    record_outcome(config, outcome, user_properties)
    return outcome


def _ignore_in_git(work_dir: Path) -> None:
    """The workdir (runs, cache) sits in the user's checkout by default: keep it out of git."""
    marker = work_dir / ".gitignore"
    if not marker.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text("# written by pytest-convergence: run folders and cache\n*\n")


def check_outcome(outcome: PairOutcome, config: pytest.Config | None = None) -> None:
    """Turn a non-passing outcome into the test's result."""
    if outcome.status == "passed":
        return
    if outcome.status == "skipped":
        pytest.skip(outcome.error or "pair skipped")
    report_dir = None
    if config is not None:
        report_dir = get_state(config).options["report"]
    raise ConvergenceFailure(outcome, report_dir=report_dir)


def _junit_properties(outcome: PairOutcome) -> list[tuple[str, object]]:
    from convergence.report import junit_properties  # lazy: plugin start-up

    return [(str(k), v) for k, v in junit_properties(outcome)]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:80] or "pair"


def record_outcome(
    config: pytest.Config,
    outcome: PairOutcome,
    user_properties: list[tuple[str, object]] | None = None,
) -> None:
    """Tell other plugins the verdict (hookspecs.py); keep the outcome in memory and, for
    the controller and later ``convergence report``, as JSON in the session folder (xdist
    workers share it with the controller); attach its JUnit properties to the test."""
    config.hook.pytest_convergence_pair_verdict(config=config, outcome=outcome)
    state = get_state(config)
    state.outcomes.append(outcome)
    if user_properties is not None:
        user_properties.extend(_junit_properties(outcome))
    if state.options["report"] is not None:
        _prerender_plot(state, outcome)
    if state.share_dir is None:
        return
    state.share_dir.mkdir(parents=True, exist_ok=True)
    name = f"{_slug(outcome.pair.pair_id)}-{uuid.uuid4().hex[:8]}{OUTCOME_SUFFIX}"
    tmp = state.share_dir / (name + ".tmp")
    from convergence.report import outcome_to_json  # lazy: plugin start-up

    tmp.write_text(json.dumps(outcome_to_json(outcome)), encoding="utf-8")
    tmp.replace(state.share_dir / name)  # atomic: the controller never reads half a file


def _prerender_plot(state: SessionState, outcome: PairOutcome) -> None:
    """Draw the pair's plot for the report now, on a background thread, while the next pair's
    jobs run (convergence.report.formats.plot_cache): not at the end of the session."""
    from convergence.report.formats.prerender import PlotPrerenderer  # lazy: plugin start-up

    if state.plots is None:
        state.plot_cache.mkdir(parents=True, exist_ok=True)
        state.plots = PlotPrerenderer(state.plot_cache)
    state.plots.submit(outcome)


def load_outcomes(folder: Path) -> list[PairOutcome]:
    from convergence.report import outcome_from_json  # lazy: plugin start-up

    outcomes = []
    for path in sorted(folder.glob(f"*{OUTCOME_SUFFIX}")):
        outcomes.append(outcome_from_json(json.loads(path.read_text(encoding="utf-8"))))
    return outcomes

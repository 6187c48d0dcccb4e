"""Reading a running job's metrics: callbacks, progress, NaN and no-progress detection.

Pure bookkeeping (no processes): :class:`JobWatch` is fed the clock and returns what the
launcher should do. Kept apart from the process handling so each can be read on its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from convergence.launch.types import FailureInfo, LaunchRequest, OnMetrics, OnProgress, Progress
from convergence.metrics.jsonl import JsonlTail
from convergence.metrics.tb_tail import TensorBoardTail


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The watch decided the job must end now (or be asked to stop)."""

    status: str
    """``stopped_early`` (ask via the stop file first), ``nan``, ``timeout``, ``hung``, or
    ``ok`` for a job that logged every step but did not exit (its failure says so)."""
    failure: FailureInfo | None = None


def record_loss(record: dict[str, Any]) -> float | None:
    """The loss of a metrics record: key ``loss``, else the first key ending in ``loss``
    (torchtitan's ``loss_metrics/global_avg_loss``)."""
    keys = ["loss"] + sorted(k for k in record if k != "loss" and k.endswith("loss"))
    for key in keys:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


PACE_STEPS = 10
"""The ETA's pace is taken over about the last PACE_STEPS steps: recent enough to follow a
job that speeds up after its first steps (warm-up, compilation, a cold page cache) or slows
down (validation, a busy machine); long enough not to jump with every step."""
MIN_STEPS_FOR_ETA = 3
"""Step intervals after the first logged step before an ETA is shown: the first interval
alone often holds a warm-up, and an ETA from it was 10-20x off."""


class JobWatch:
    """Follows one job's metrics JSONL and applies the watchdog limits."""

    def __init__(
        self,
        request: LaunchRequest,
        *,
        start: float,
        on_metrics: OnMetrics | None = None,
        on_progress: OnProgress | None = None,
        progress_interval_s: float = 1.0,
    ) -> None:
        self.request = request
        self.start = start
        self.on_metrics = on_metrics
        self.on_progress = on_progress
        self.progress_interval_s = progress_interval_s
        self._tail: JsonlTail | TensorBoardTail | None = None
        if request.metrics_path is not None:
            self._tail = (
                TensorBoardTail(request.metrics_path)
                if request.metrics_format == "tensorboard"
                else JsonlTail(request.metrics_path)
            )
        self.last_step: int | None = None
        self.last_loss: float | None = None
        self._last_line_at = start  # counting from start: a job hanging before step 1 is hung
        self._num_lines = 0
        self._progress_at: float | None = None
        self._progress_step: int | None = None
        self._first_step: int | None = None
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=PACE_STEPS + 1)
        """(last step, time) of each poll that brought new steps: the ETA's recent pace."""
        self.stopping = False
        """Set once a verdict was returned: later records only update ``last_step``."""

    def poll(self, now: float, *, final: bool = False) -> Verdict | None:
        """Read new records, run callbacks; return a verdict if the job must end.
        ``final``: the job ended, take every record left (a TensorBoard tail's last step)."""
        verdict: Verdict | None = None
        before = self.last_step
        records = (self._tail.drain() if final else self._tail.poll()) if self._tail else []
        for record in records:
            verdict = self._take(record, now) or verdict
        if self.last_step is not None and self.last_step != before:
            # One arrival per poll: records read together share a time, so timing them one
            # by one would give zero-length steps.
            self._arrivals.append((self.last_step, now))
        self._maybe_progress(now)
        if verdict is not None or self.stopping:
            return verdict
        return self._limits(now)

    def finish(self, now: float) -> Verdict | None:
        """Drain the file after the process ended; a NaN there still counts."""
        verdict = self.poll(now, final=True) if self._tail else None
        self._maybe_progress(now, force=True)
        return verdict if verdict is not None and verdict.status == "nan" else None

    def _take(self, record: dict[str, Any], now: float) -> Verdict | None:
        self._last_line_at = now
        if "event" in record:
            return None  # an annotation (restart, stop): alive, but not a metrics step
        self._num_lines += 1
        step_value = record.get("step")
        step = int(step_value) if isinstance(step_value, (int, float)) else self._num_lines
        self.last_step = step
        if self._first_step is None:
            self._first_step = step
        self.last_loss = record_loss(record)
        if self.stopping:
            return None
        if self.last_loss is not None and not math.isfinite(self.last_loss):
            self.stopping = True
            message = (
                f"job {self.request.name!r}: loss is {self.last_loss} at step {step} "
                f"({self.request.metrics_path})"
            )
            return Verdict(status="nan", failure=FailureInfo(message=message, step=step))
        if self.on_metrics is not None and self.on_metrics(record):
            self.stopping = True
            return Verdict(status="stopped_early")
        return None

    def _limits(self, now: float) -> Verdict | None:
        req = self.request
        elapsed = now - self.start
        at = f"last step {self.last_step}" if self.last_step is not None else "no step logged"
        if elapsed > req.wall_limit_s:
            self.stopping = True
            msg = (
                f"job {req.name!r} exceeded its wall-clock limit of {req.wall_limit_s:g} s "
                f"({at}); raise wall_limit_s if the job is just slow"
            )
            return Verdict(status="timeout", failure=FailureInfo(message=msg, step=self.last_step))
        # Without a metrics file there is no progress signal: only the wall limit applies. A
        # TensorBoard job (torchtitan) is idle-limited from its first step on: its start-up
        # (model build, checkpoint load, compilation) can take longer than any idle limit
        # fitting a step, and before this tail existed it had only the wall limit.
        watched = self._tail is not None and (
            req.metrics_format != "tensorboard" or self.last_step is not None
        )
        if watched and now - self._last_line_at > req.idle_limit_s:
            self.stopping = True
            if req.total_steps is not None and (self.last_step or 0) >= req.total_steps:
                # Every step is logged but the job does not exit (a stopped or stuck torchrun
                # agent, a rank stuck in teardown): the run is complete; end it, keep it.
                msg = (
                    f"job {req.name!r} logged all {req.total_steps} steps but did not exit "
                    f"within {req.idle_limit_s:g} s; it was ended and its run kept"
                )
                return Verdict(status="ok", failure=FailureInfo(message=msg, step=self.last_step))
            msg = (
                f"job {req.name!r} hung: no new line in {req.metrics_path} for "
                f"{req.idle_limit_s:g} s ({at})"
            )
            return Verdict(status="hung", failure=FailureInfo(message=msg, step=self.last_step))
        return None

    def _maybe_progress(self, now: float, *, force: bool = False) -> None:
        if self.on_progress is None or self.last_step is None:
            return
        if self._progress_step == self.last_step:
            return
        due = self._progress_at is None or now - self._progress_at >= self.progress_interval_s
        if not (due or force):
            return
        self._progress_at, self._progress_step = now, self.last_step
        self.on_progress(
            Progress(
                name=self.request.name,
                step=self.last_step,
                total_steps=self.request.total_steps,
                loss=self.last_loss,
                elapsed_s=now - self.start,
                pace_s=self.pace_s(),
            )
        )

    def pace_s(self) -> float | None:
        """Seconds per step over about the last :data:`PACE_STEPS` steps, from the times the
        steps arrived; None until :data:`MIN_STEPS_FOR_ETA` intervals followed the first
        logged step (torchrun's start-up before it never counts)."""
        if self._first_step is None or not self._arrivals:
            return None
        last_step, last_at = self._arrivals[-1]
        if last_step - self._first_step < MIN_STEPS_FOR_ETA:
            return None
        earlier = [(s, t) for s, t in list(self._arrivals)[:-1] if last_step - s <= PACE_STEPS]
        if not earlier:  # the window's steps all came in one poll: take the poll before
            earlier = list(self._arrivals)[-2:-1]
        if not earlier:
            return None
        step0, at0 = earlier[0]
        if last_step <= step0 or last_at <= at0:
            return None
        return (last_at - at0) / (last_step - step0)

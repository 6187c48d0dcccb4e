"""Progress events as text, shared by the pytest plugin and the ``convergence`` command.

    [fsdp2-tp2 test] starting (4 ranks, local launcher)
    [fsdp2-tp2 test] step 37/200 loss 3.214 ETA 0:41

No ETA is printed until the watch has a pace to take it from (see
:attr:`convergence.launch.types.Progress.eta_s`): an "ETA ?" or a guess from step 1 told the
reader nothing, or something 10-20x off.
"""

from __future__ import annotations

from convergence.launch.types import Progress

LOG_FRACTION = 10
"""In a log (not a terminal): a line each 1/LOG_FRACTION of a job's steps."""


def format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_progress(p: Progress) -> str:
    if p.note:
        return f"[{p.name}] {p.note}"
    total = f"/{p.total_steps}" if p.total_steps else ""
    loss = f" loss {p.loss:.4g}" if p.loss is not None else ""
    eta = p.eta_s
    return f"[{p.name}] step {p.step}{total}{loss}" + (
        "" if eta is None else f" ETA {format_eta(eta)}"
    )


class LogThrottle:
    """Which progress events become a line in a log (not a terminal): every note ("starting
    ..."), then one line per job each 1/LOG_FRACTION of its steps."""

    def __init__(self) -> None:
        self._logged_bucket: dict[str, int] = {}

    def line(self, p: Progress) -> str | None:
        if p.note:
            self._logged_bucket.pop(p.name, None)
            return format_progress(p)
        if not p.total_steps:
            return None
        bucket = p.step * LOG_FRACTION // p.total_steps
        last = self._logged_bucket.get(p.name)
        if last is not None and bucket <= last:
            return None
        self._logged_bucket[p.name] = bucket
        return format_progress(p)

"""The suite's power across weeks: ``convergence selftest`` rows in a history, and a drop in
power as a drift finding of ``convergence decide``.

A night that runs the selftest (weekly: ``convergence nightly --selftest EXP``) appends one
JSON line per selftest row (``--record-power FILE``): layout, bug, caught or missed, at which
step by which metric. On that night ``convergence decide --power FILE`` compares the row with
the same pair and bug of the previous selftest night:

- a bug caught before and not caught now (missed, inconclusive, not planted any more);
- a bug caught later than before by more than ``step_slack`` steps;
- a correct layout that passed before and false-alarms now;

each is a drift finding like the others (exit 10, the same hooks). Why against the previous
selftest and not a band of weeks: the table is deterministic per stack (a planted bug is
caught at step 1 or it is not), so one change is the signal; and a week apart is as far back
as a weekly check can look without waiting a month for a band.

Only the night that ran the selftest is compared: the nights between it and the next do not
repeat the finding.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convergence.nightly.decide import Finding
from convergence.nightly.history import NightRecord, read_history
from convergence.spec.errors import SpecError

POWER_VERSION = 1
#: Caught later than the last selftest by more than this many steps: a drop in power.
DEFAULT_STEP_SLACK = 2


def power_records(
    rows: Iterable[Mapping[str, Any]], *, night: str, experiment: str
) -> list[dict[str, Any]]:
    """One power-history line per selftest row."""
    return [
        {
            "power_version": POWER_VERSION,
            "night": night,
            "experiment": experiment,
            "pair": str(row["pair"]),
            "layout": row.get("layout"),
            "bug": str(row["bug"]),
            "status": str(row["status"]),
            "step": row.get("step"),
            "metric": row.get("metric"),
            "worst_share": row.get("worst_share"),
        }
        for row in rows
    ]


def append_power(
    rows: Iterable[Mapping[str, Any]], path: Path, *, night: str, experiment: str
) -> list[dict[str, Any]]:
    records = power_records(rows, night=night, experiment=experiment)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
    return records


def last_selftest(path: Path, experiment: str) -> str | None:
    """The last night ``experiment`` was selftested in the power history (None: never, or no
    history yet)."""
    if not path.is_file():
        return None
    try:
        records = read_history(path).records
    except SpecError:  # an empty or unreadable history: as if none
        return None
    nights = [r["night"] for r in records if r.get("experiment") == experiment]
    return str(nights[-1]) if nights else None


def due(path: Path, experiment: str, *, every_days: float, now: dt.datetime | None = None) -> bool:
    """Whether ``experiment``'s selftest is due: never run, or its last night started at least
    ``every_days`` ago less half a day (a weekly night that starts a little earlier than last
    week's is still due)."""
    night = last_selftest(path, experiment)
    if night is None:
        return True
    when = NightRecord(night=night, pair="-", status="-").night_time()
    if when is None:
        return True
    now = now or dt.datetime.now(dt.timezone.utc)
    return now.timestamp() - when >= (every_days - 0.5) * 86400


def power_drops(
    records: Sequence[Mapping[str, Any]], *, night: str, step_slack: int = DEFAULT_STEP_SLACK
) -> list[Finding]:
    """The drops in power of ``night`` against each row's previous selftest night (see the
    module docstring); none when ``night`` ran no selftest."""
    before: dict[tuple[str, str], Mapping[str, Any]] = {}
    tonight: dict[tuple[str, str], Mapping[str, Any]] = {}
    for record in records:
        key = (str(record["pair"]), str(record["bug"]))
        if record["night"] == night:
            tonight[key] = record
        elif key not in tonight:  # the file is appended in night order
            before[key] = record
    findings = []
    for key, now in sorted(tonight.items()):
        old = before.get(key)
        if old is not None:
            text = _dropped(old, now, step_slack)
            if text:
                findings.append(
                    Finding(
                        pair=key[0],
                        kind="drift",
                        metric="selftest power",
                        text=f"{key[0]}: selftest {text} (last selftest {old['night']})",
                    )
                )
    return findings


def _dropped(old: Mapping[str, Any], now: Mapping[str, Any], step_slack: int) -> str | None:
    bug = now["bug"]
    if old["status"] == "passes" and now["status"] == "FALSE ALARM":
        return f"correct layout false-alarms now (step {now.get('step')}, {now.get('metric')})"
    if old["status"] != "caught":
        return None
    if now["status"] != "caught":
        return f"bug {bug} caught at step {old.get('step')} before, {now['status']} now"
    a, b = old.get("step"), now.get("step")
    if isinstance(a, int) and isinstance(b, int) and b - a > step_slack:
        return (
            f"bug {bug} caught at step {b} ({now.get('metric')}), {b - a} steps later than "
            f"before (step {a}; more than {step_slack})"
        )
    return None


def read_power(path: Path) -> list[dict[str, Any]]:
    """The power history's lines (empty when the file does not exist yet)."""
    if not path.is_file():
        return []
    return [dict(r) for r in read_history(path).records]

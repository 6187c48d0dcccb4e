"""The nightly history: one JSON line per pair per night, appended by ``convergence record``.

Why JSONL: appending is atomic enough for one writer a night, and a broken night (a truncated
line) never hides the others: unreadable lines are skipped and counted.

What a line holds is what a regression of the stack (driver, NCCL, torch, kernels) moves, not
only what the pair's verdict judged: the verdict, the test-minus-control final loss, the
control's own final loss (a stack change moves both sides alike, so the delta stays flat while
the control's loss drifts), step time and tokens/s of both sides, and peak memory.

Each line also names the commit the night ran (``commit``, from ``convergence record
--commit`` or the checkout's HEAD) and the pair's experiment file (``source``): when a pair
turns red, ``convergence decide`` prints the ``convergence bisect`` command between the last
green night's commit and tonight's.

Versions: version 1 lines (before ``control_final_loss``, ``step_time_s``) still load; what
they lack reads as None (:meth:`NightRecord.from_json`).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergence.spec.errors import SpecError

HISTORY_VERSION = 2
#: Where a recorded step time came from (``step_time_from``): the report's median seconds per
#: step (tokens per step / tokens/s per step, see convergence.report.data.records.step_time_s), or,
#: when the run's meta had no tokens per step, the side's wall time / its steps.
STEP_TIME_SOURCES = ("tokens_per_s", "wall")
#: The night names ``convergence record`` and the sbatch script make start with a UTC stamp.
_NIGHT_STAMP = re.compile(r"(\d{8}T\d{6}Z)")


def num(value: Any) -> float | None:
    """A report number (non-finite ones are strings there) as a float; None if absent."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def json_num(value: float | None) -> float | str | None:
    """A float for JSON: non-finite values as the strings the report uses."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


# -- report.json -> records -----------------------------------------------------------------


def _loss_curve(pair: Mapping[str, Any], side: str) -> dict[str, Any] | None:
    curve = ((pair.get("curves") or {}).get(side) or {}).get("loss")
    return curve if curve and curve.get("steps") else None


def final_loss_delta(pair: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """(step, test − control) at the last step both loss curves have; (None, None) without
    curves (a report written without them, or a pair that errored)."""
    control, test = _loss_curve(pair, "control"), _loss_curve(pair, "test")
    if not control or not test:
        return None, None
    c = {int(s): num(v) for s, v in zip(control["steps"], control["values"], strict=True)}
    t = {int(s): num(v) for s, v in zip(test["steps"], test["values"], strict=True)}
    common = sorted(set(c) & set(t))
    if not common:
        return None, None
    step = common[-1]
    a, b = c[step], t[step]
    return step, (None if a is None or b is None else b - a)


def control_final_loss(pair: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """(step, loss) at the control curve's last logged step, whether or not the test got there
    (an errored test still tells whether the control moved); (None, None) without a curve."""
    curve = _loss_curve(pair, "control")
    if not curve:
        return None, None
    last = max(range(len(curve["steps"])), key=lambda i: int(curve["steps"][i]))
    return int(curve["steps"][last]), num(curve["values"][last])


def _resource(pair: Mapping[str, Any], metric: str) -> dict[str, float | None]:
    entry = (pair.get("resources") or {}).get(metric) or {}
    return {k: num(entry.get(k)) for k in ("control", "test", "ratio")}


def _wall_step_time(pair: Mapping[str, Any], side: str) -> float | None:
    """The side's wall time / its steps (last logged step, else the configured steps). It
    includes start-up and compilation, so it is an upper bound, used only as a fallback."""
    record = pair.get(side) or {}
    wall = num(record.get("wall_s"))
    steps = record.get("last_step") or record.get("steps")
    if wall is None or not isinstance(steps, int) or steps <= 0 or wall <= 0:
        return None
    return wall / steps


def step_times(pair: Mapping[str, Any]) -> tuple[dict[str, float | None], dict[str, str | None]]:
    """Seconds per optimizer step of control and test, and where each came from.

    First the report's ``resources.step_time_s``: the median over steps of tokens per step /
    tokens/s (the run's meta gives tokens per step; the first step left out), the figure that
    tracks kernels and communication. Without it (no tokens per step in the run's meta, or a
    report from before that field) the side's wall time / steps, marked ``"wall"``.
    """
    reported = _resource(pair, "step_time_s")
    values: dict[str, float | None] = {}
    sources: dict[str, str | None] = {}
    for side in ("control", "test"):
        value, source = reported[side], "tokens_per_s"
        if value is None:
            value, source = _wall_step_time(pair, side), "wall"
        values[side], sources[side] = value, (source if value is not None else None)
    control, test = values["control"], values["test"]
    values["ratio"] = test / control if control and test is not None else None
    return values, sources


def _encoded(values: Mapping[str, float | None]) -> dict[str, float | str | None]:
    return {k: json_num(v) for k, v in values.items()}


def current_commit(folder: Path) -> str | None:
    """The commit checked out in ``folder`` (``git rev-parse HEAD``), None outside a git
    repository or without git: the history then records no commit, and says so nowhere else."""
    import subprocess

    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def history_records(
    report: Mapping[str, Any],
    *,
    night: str,
    pytest_status: int | None = None,
    commit: str | None = None,
) -> list[dict[str, Any]]:
    """One history record (a JSON-ready dict, one line of the file) per pair of a report."""
    env = report.get("environment") or {}
    records = []
    for pair in report.get("pairs", []):
        step, delta = final_loss_delta(pair)
        control_step, control_loss = control_final_loss(pair)
        step_time, step_time_from = step_times(pair)
        records.append(
            {
                "history_version": HISTORY_VERSION,
                "night": night,
                "generated_at": report.get("generated_at"),
                "slurm_job_id": env.get("slurm_job_id") or os.environ.get("SLURM_JOB_ID"),
                "pytest_status": pytest_status,
                "pair": pair["id"],
                "commit": commit or None,
                "source": pair.get("source") or None,
                "status": pair["status"],
                "verdicts": {v["metric"]: bool(v["passed"]) for v in pair.get("verdicts", [])},
                "final_step": step,
                "final_loss_delta": json_num(delta),
                "control_final_step": control_step,
                "control_final_loss": json_num(control_loss),
                "max_abs_loss_delta": (pair.get("max_abs_delta") or {}).get("loss"),
                "tokens_per_s": _encoded(_resource(pair, "tokens_per_s")),
                "peak_mem_mib": _encoded(_resource(pair, "peak_mem_mib")),
                "step_time_s": _encoded(step_time),
                "step_time_from": step_time_from,
                "wall_s": (pair.get("wall_s") or {}).get("pair"),
            }
        )
    return records


def _not_a_report(path: Path, message: str, *, key: str | None = None) -> SpecError:
    return SpecError(
        message,
        file=str(path),
        key=key,
        fix="pass the report.json written by --convergence-report",
    )


def load_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _not_a_report(path, f"cannot read the report: {exc.strerror}") from None
    except ValueError as exc:
        raise _not_a_report(path, f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("pairs"), list):
        raise _not_a_report(path, "not a pytest-convergence report (no 'pairs' list)", key="pairs")
    return data


def append_history(
    report_path: Path,
    history: Path,
    *,
    night: str,
    pytest_status: int | None = None,
    commit: str | None = None,
) -> list[dict[str, Any]]:
    """Append the night's records to ``history`` (created with its folder if needed)."""
    records = history_records(
        load_report(report_path), night=night, pytest_status=pytest_status, commit=commit
    )
    history.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    with open(history, "a", encoding="utf-8") as fh:
        fh.write(text)
    return records


# -- reading it back ------------------------------------------------------------------------


def _side_value(raw: Mapping[str, Any], key: str, side: str) -> float | None:
    """``raw[key][side]``; a bare number counts as the test's (the test is what a row shows)."""
    value = raw.get(key)
    if isinstance(value, Mapping):
        return num(value.get(side))
    return num(value) if side == "test" else None


def _timestamp(text: str) -> float | None:
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))  # 3.10 has no 'Z'
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


@dataclass(frozen=True, kw_only=True)
class NightRecord:
    """One pair on one night, as the trend reads it (any history version)."""

    night: str
    pair: str
    status: str
    """The pair's status that night: passed | failed | error | skipped."""
    generated_at: str | None = None
    pytest_status: int | None = None
    verdicts: Mapping[str, bool] = field(default_factory=dict)
    final_step: int | None = None
    final_loss_delta: float | None = None
    control_final_loss: float | None = None
    step_time_s: float | None = None
    control_step_time_s: float | None = None
    step_time_from: Mapping[str, str | None] = field(default_factory=dict)
    tokens_per_s: float | None = None
    control_tokens_per_s: float | None = None
    peak_mem_mib: float | None = None
    wall_s: float | None = None
    commit: str | None = None
    """The commit the night ran (None in histories written before it was recorded)."""
    source: str | None = None
    """The pair's experiment file, as the report names it."""

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> NightRecord:
        """From a history line; fields a line lacks (older versions) are None."""
        step = raw.get("final_step")
        status = raw.get("pytest_status")
        return cls(
            night=str(raw["night"]),
            pair=str(raw["pair"]),
            status=str(raw.get("status") or "unknown"),
            generated_at=raw.get("generated_at")
            if isinstance(raw.get("generated_at"), str)
            else None,
            pytest_status=status if isinstance(status, int) else None,
            verdicts=dict(raw.get("verdicts") or {}),
            final_step=step if isinstance(step, int) else None,
            final_loss_delta=num(raw.get("final_loss_delta")),
            control_final_loss=num(raw.get("control_final_loss")),
            step_time_s=_side_value(raw, "step_time_s", "test"),
            control_step_time_s=_side_value(raw, "step_time_s", "control"),
            step_time_from=dict(raw.get("step_time_from") or {}),
            tokens_per_s=_side_value(raw, "tokens_per_s", "test"),
            control_tokens_per_s=_side_value(raw, "tokens_per_s", "control"),
            peak_mem_mib=_side_value(raw, "peak_mem_mib", "test"),
            wall_s=num(raw.get("wall_s")),
            commit=raw["commit"] if isinstance(raw.get("commit"), str) else None,
            source=raw["source"] if isinstance(raw.get("source"), str) else None,
        )

    @property
    def passed(self) -> float | None:
        """1.0 passed, 0.0 failed, inconclusive or error (no verdict is not a pass), None
        skipped."""
        if self.status == "passed":
            return 1.0
        return 0.0 if self.status in ("failed", "inconclusive", "error") else None

    def night_time(self) -> float | None:
        """The night's start as a Unix time: the UTC stamp the night's name starts with (the
        sbatch script's and ``convergence record``'s names), else the report's generation
        time; None when neither parses."""
        match = _NIGHT_STAMP.match(self.night)
        if match:
            try:  # a name of the right shape can still name no date (month 13, hour 25)
                stamp = dt.datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ")
                return stamp.replace(tzinfo=dt.timezone.utc).timestamp()
            except ValueError:
                pass
        return _timestamp(self.generated_at) if self.generated_at else None


@dataclass(frozen=True, kw_only=True)
class History:
    records: tuple[dict[str, Any], ...]
    """The lines as written (dicts), in file order."""
    skipped_lines: int = 0
    """Lines that were not a JSON object (e.g. a night killed while writing)."""

    def nights(self) -> list[str]:
        """Night names in the order they first appear (the file is appended night by night)."""
        seen: dict[str, None] = {}
        for r in self.records:
            seen.setdefault(str(r["night"]), None)
        return list(seen)

    def entries(self) -> tuple[NightRecord, ...]:
        """The records parsed, whatever their version."""
        return tuple(NightRecord.from_json(r) for r in self.records)


def read_history(path: Path) -> History:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpecError(
            f"cannot read the history: {exc.strerror}",
            file=str(path),
            fix="pass the history.jsonl that `convergence record` appends to",
        ) from None
    records, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and "pair" in record and "night" in record:
            records.append(record)
        else:
            skipped += 1
    if not records:
        raise SpecError(
            "no history records in it",
            file=str(path),
            fix="run a night first (sbatch the script from `convergence nightly`)",
        )
    return History(records=tuple(records), skipped_lines=skipped)

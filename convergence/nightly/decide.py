"""The trend that decides: tonight against the band of the last green nights.

    convergence decide HISTORY.jsonl --out DIR [--window 20] [--k 6] [--hook CMD] [--post URL]

For every pair that ran tonight (the history's last night):

- *turned red*: it failed or errored tonight and passed the last night it ran;
- *drift*: a metric lies outside the band of the pair's last ``window`` green (passed) nights
  before tonight: the control's final loss (either direction: a stack change moves it),
  max |Δloss| of test vs control, step time, tokens/s and peak memory (the way that is worse).

The band is robust: median ± k × max(1.4826 × MAD, relative floor × |median|, absolute floor).
The MAD ignores a single odd night in the window (one outlier moves a mean and a standard
deviation, not a median); the floors keep a perfectly flat series (a deterministic CPU control
repeats its loss to the last bit) from flagging the last-digit change of a harmless rebuild.
Fewer than ``min_nights`` green nights: no band, no decision for that metric (said so).

False alarms, measured on simulated histories (``tests/test_nightly_decide.py``: 10 pairs ×
150 nights of i.i.d. normal noise, each night decided against the nights before it): with the
defaults (window 20, k 6) 0 of 9100 pair-metric-nights flagged (a sparser sweep: 0-0.05%);
window 10 / k 5 flagged 0.24-0.28% -- about one false alarm every three nights for 20 pairs x
7 metrics, because the MAD of 10 samples is itself noisy (heavier tails than a normal's). A
drift of 10 σ is flagged on the night it appears.

Exit status (``convergence decide``, and the nightly script when pytest itself passed):
:data:`EXIT_CLEAN` 0, :data:`EXIT_DRIFT` 10, :data:`EXIT_RED` 11 (a pair turned red; wins over
drift). ``DIR/decision.json`` and ``DIR/decision.md`` hold the short summary; the hooks
(a shell command with the summary on stdin, an HTTP POST of decision.json, and
``$GITHUB_STEP_SUMMARY`` where set) fire when there is something to say (``--notify always``:
every night).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from convergence.nightly.history import History, NightRecord, num

EXIT_CLEAN, EXIT_DRIFT, EXIT_RED = 0, 10, 11

#: (NightRecord field or raw key, worse direction: "both" | "up" | "down", label)
DECIDED: tuple[tuple[str, str, str], ...] = (
    ("control_final_loss", "both", "control final loss"),
    ("max_abs_loss_delta", "up", "max |Δloss| test vs control"),
    ("step_time_s", "up", "step time s (test)"),
    ("control_step_time_s", "up", "step time s (control)"),
    ("tokens_per_s", "down", "tokens/s (test)"),
    ("control_tokens_per_s", "down", "tokens/s (control)"),
    ("peak_mem_mib", "up", "peak memory MiB (test)"),
)
#: Relative floor of the band's half width per metric (before k): timings are noisier than
#: losses, and a deterministic loss repeats exactly.
REL_FLOOR = {
    "control_final_loss": 1e-6,
    "max_abs_loss_delta": 0.05,
    "step_time_s": 0.01,
    "control_step_time_s": 0.01,
    "tokens_per_s": 0.01,
    "control_tokens_per_s": 0.01,
    "peak_mem_mib": 0.005,
}
ABS_FLOOR = {"max_abs_loss_delta": 1e-7}


@dataclass(frozen=True, kw_only=True)
class BandSettings:
    window: int = 20
    """How many of the last green nights form the band."""
    k: float = 6.0
    """Half width in robust standard deviations."""
    min_nights: int = 5
    """Fewer green nights than this: no decision for the metric."""

    def __post_init__(self) -> None:
        if self.window < 2 or self.min_nights < 2 or self.min_nights > self.window:
            raise ValueError(
                f"need 2 <= min_nights <= window, got window={self.window}, "
                f"min_nights={self.min_nights}"
            )
        if not self.k > 0:
            raise ValueError(f"k must be > 0, got {self.k}")


@dataclass(frozen=True, kw_only=True)
class Finding:
    pair: str
    kind: str
    """``drift`` or ``red``."""
    metric: str | None = None
    value: float | None = None
    low: float | None = None
    high: float | None = None
    median: float | None = None
    nights: int = 0
    """Green nights the band was made of."""
    text: str = ""
    bisect: str | None = None
    """A red pair: the ``convergence bisect`` command between the last green night's commit
    and tonight's (None when the history does not record them, or they are the same)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    night: str | None
    findings: tuple[Finding, ...] = ()
    undecided: tuple[str, ...] = ()
    """``pair: metric`` lacking enough green nights for a band."""
    pairs: int = 0
    settings: BandSettings = field(default_factory=BandSettings)

    @property
    def exit_status(self) -> int:
        if any(f.kind == "red" for f in self.findings):
            return EXIT_RED
        return EXIT_DRIFT if self.findings else EXIT_CLEAN

    def to_json(self) -> dict[str, object]:
        return {
            "night": self.night,
            "exit_status": self.exit_status,
            "pairs": self.pairs,
            "findings": [asdict(f) for f in self.findings],
            "undecided": list(self.undecided),
            "settings": asdict(self.settings),
        }


def band(values: Sequence[float], metric: str, k: float) -> tuple[float, float, float]:
    """(low, median, high) of the robust band (see the module docstring)."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    half = k * max(
        1.4826 * mad, REL_FLOOR.get(metric, 0.01) * abs(median), ABS_FLOOR.get(metric, 0.0)
    )
    return median - half, median, median + half


def _value(record: NightRecord, raw: dict[str, object], metric: str) -> float | None:
    if hasattr(record, metric):
        value = getattr(record, metric)
        return value if isinstance(value, float) else None
    return num(raw.get(metric))


def decide(history: History, settings: BandSettings | None = None) -> Decision:
    """Tonight (the last night of ``history``) against the earlier nights."""
    cfg = settings or BandSettings()
    nights = history.nights()
    if not nights:
        return Decision(night=None, settings=cfg)
    tonight = nights[-1]
    per_pair: dict[str, list[tuple[NightRecord, dict[str, object]]]] = {}
    for raw, record in zip(history.records, history.entries(), strict=True):
        per_pair.setdefault(record.pair, []).append((record, raw))
    findings: list[Finding] = []
    undecided: list[str] = []
    pairs = 0
    for pair, rows in sorted(per_pair.items()):
        # One record per pair and night: the last written wins (as in the trend).
        by_night = {r.night: (r, raw) for r, raw in rows}
        if tonight not in by_night:
            continue
        pairs += 1
        now, now_raw = by_night[tonight]
        earlier = [by_night[n] for n in nights[:-1] if n in by_night]
        if now.status in ("failed", "error") and earlier and earlier[-1][0].status == "passed":
            green_night = earlier[-1][0]
            findings.append(
                Finding(
                    pair=pair,
                    kind="red",
                    text=f"{pair}: turned {now.status} tonight (passed on {green_night.night})",
                    bisect=bisect_command(green_night, now),
                )
            )
        if now.status != "passed":
            continue  # a red or skipped pair's numbers are not compared
        green = [(r, raw) for r, raw in earlier if r.status == "passed"][-cfg.window :]
        for metric, worse, label in DECIDED:
            value = _value(now, now_raw, metric)
            if value is None:
                continue
            past = [
                v
                for v in (_value(r, raw, metric) for r, raw in green)
                if v is not None and math.isfinite(v)
            ]
            if len(past) < cfg.min_nights:
                undecided.append(
                    f"{pair}: {metric} ({len(past)} green nights, need {cfg.min_nights})"
                )
                continue
            low, median, high = band(past, metric, cfg.k)
            out = (value > high and worse in ("up", "both")) or (
                value < low and worse in ("down", "both")
            )
            if out:
                findings.append(
                    Finding(
                        pair=pair,
                        kind="drift",
                        metric=metric,
                        value=value,
                        low=low,
                        high=high,
                        median=median,
                        nights=len(past),
                        text=(
                            f"{pair}: {label} {value:.6g} outside [{low:.6g}, {high:.6g}] "
                            f"(median {median:.6g} of the last {len(past)} green nights)"
                        ),
                    )
                )
    return Decision(
        night=tonight,
        findings=tuple(findings),
        undecided=tuple(undecided),
        pairs=pairs,
        settings=cfg,
    )


def bisect_command(green: NightRecord, red: NightRecord) -> str | None:
    """``convergence bisect GREEN RED PAIR --experiment FILE`` for a pair that turned red, from
    the commits the two nights recorded; None when a night lacks one (histories written before
    ``convergence record`` recorded commits) or both ran the same commit (then no commit made
    it red: the stack, the data or flakiness did)."""
    if not green.commit or not red.commit or green.commit == red.commit:
        return None
    words = ["convergence", "bisect", green.commit[:12], red.commit[:12], red.pair]
    if red.source:
        words += ["--experiment", red.source]
    return shlex.join(words)


def summary_markdown(decision: Decision) -> str:
    head = {
        EXIT_CLEAN: "no drift, no pair turned red",
        EXIT_DRIFT: "DRIFT",
        EXIT_RED: "A PAIR TURNED RED",
    }[decision.exit_status]
    lines = [
        f"## Nightly convergence {decision.night or '(no nights)'}: {head}",
        "",
        f"{decision.pairs} pair(s) ran tonight; band: the last {decision.settings.window} "
        f"green nights, median ± {decision.settings.k:g} robust σ.",
        "",
    ]
    for finding in decision.findings:
        lines.append(f"- {finding.text}")
        if finding.bisect:
            lines.append(f"  find the commit that did it: `{finding.bisect}`")
        elif finding.kind == "red":
            lines.append(
                "  (no bisect command: the history names no commit for one of the two nights, "
                "or both ran the same one)"
            )
    if decision.undecided:
        lines += ["", f"Not decided yet ({len(decision.undecided)}): too few green nights."]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class Notify:
    command: str | None = None
    """Shell command; the markdown summary on stdin, CONVERGENCE_DECISION=<decision.json>."""
    url: str | None = None
    """HTTP(S) URL that receives decision.json as a POST (application/json)."""
    always: bool = False
    """Notify on clean nights too."""


def write_decision(decision: Decision, out: Path, notify: Notify | None = None) -> list[str]:
    """Write ``decision.json``/``decision.md`` under ``out``, fire the hooks; returns the
    problems the hooks had (never raised: a broken hook must not hide the night's status)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = json.dumps(decision.to_json(), indent=1, sort_keys=True)
    (out / "decision.json").write_text(doc + "\n")
    text = summary_markdown(decision)
    (out / "decision.md").write_text(text)
    problems: list[str] = []
    hooks = notify or Notify()
    if decision.exit_status == EXIT_CLEAN and not hooks.always:
        return problems
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        try:
            with open(step_summary, "a", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            problems.append(f"GITHUB_STEP_SUMMARY: {exc}")
    if hooks.command:
        try:
            done = subprocess.run(
                hooks.command,
                shell=True,
                input=text,
                text=True,
                capture_output=True,
                timeout=60,
                env={**os.environ, "CONVERGENCE_DECISION": str(out / "decision.json")},
            )
            if done.returncode != 0:
                problems.append(
                    f"hook command exited {done.returncode}: {done.stderr.strip()[-300:]}"
                )
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"hook command: {exc}")
    if hooks.url:
        request = urllib.request.Request(
            hooks.url,
            data=doc.encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                response.read()
        except OSError as exc:  # URLError and HTTPError are OSErrors
            problems.append(f"POST {hooks.url}: {exc}")
    return problems

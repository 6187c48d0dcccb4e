"""The trend across nights: per pair, per night, the verdict and what a regression moves.

``convergence trend HISTORY.jsonl --out DIR`` writes, all from the whole history:

- ``trend.md``: an overview (pass/fail per night per pair) and per pair a table night |
  verdict | final loss Δ | control final loss | step time (s) | tokens/s; a night the pair did
  not run reads "absent";
- ``trend.json``: the same series, one value per night (None where the pair did not run);
- ``trend.png`` (final loss Δ) and ``trend_<metric>.png``: one small panel per pair
  (convergence.nightly.trend_plots);
- ``tensorboard/<pair>/``: the scalars as TensorBoard runs (convergence.nightly.tensorboard_export).

A night's position in the history (0, 1, ...) is its index everywhere: in the series, on the
plots' x axis and as the TensorBoard step. The history only grows at the end, so an index
never changes meaning when the trend is rewritten after the next night.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from convergence.nightly.history import History, NightRecord, json_num, read_history
from convergence.nightly.tensorboard_export import export_tensorboard
from convergence.nightly.trend_plots import PLOTS, plot_trend_panels

#: The numeric series per pair: (field of NightRecord, label).
TREND_METRICS: tuple[tuple[str, str], ...] = (
    ("final_loss_delta", "final loss Δ (test − control)"),
    ("control_final_loss", "control final loss"),
    ("step_time_s", "step time s (test)"),
    ("control_step_time_s", "step time s (control)"),
    ("tokens_per_s", "tokens/s (test)"),
    ("control_tokens_per_s", "tokens/s (control)"),
    ("peak_mem_mib", "peak memory MiB (test)"),
    ("passed", "passed (1 passed, 0 failed or error)"),
)
#: How the overview writes a verdict (a night the pair did not run: ABSENT_MARK).
VERDICT_MARKS = {"passed": "✓", "failed": "✗", "inconclusive": "?", "error": "E", "skipped": "s"}
ABSENT_MARK = "·"
ABSENT = "absent"
Series = dict[str, dict[str, list[float | None]]]


@dataclass(frozen=True, kw_only=True)
class Trend:
    nights: tuple[str, ...]
    night_times: tuple[float | None, ...]
    """Unix time of each night (see NightRecord.night_time); None where it does not parse."""
    series: Series
    """pair -> metric -> value per night (None where the pair did not run or had no value)."""
    statuses: dict[str, list[str | None]]
    """pair -> verdict status per night (None where the pair did not run)."""
    rows: dict[str, list[NightRecord | None]]
    """pair -> its record per night (None where it did not run)."""
    skipped_lines: int = 0

    def pairs(self) -> list[str]:
        return sorted(self.series)


def build_trend(history: History) -> Trend:
    """Series per pair over every night of the history. A pair recorded twice in one night
    (``convergence record`` run again) keeps its last record."""
    nights = history.nights()
    index = {n: i for i, n in enumerate(nights)}
    times: list[float | None] = [None] * len(nights)
    rows: dict[str, list[NightRecord | None]] = {}
    for entry in history.entries():
        i = index[entry.night]
        rows.setdefault(entry.pair, [None] * len(nights))[i] = entry
        if times[i] is None:
            times[i] = entry.night_time()
    series: Series = {
        pair: {
            metric: [None if r is None else getattr(r, metric) for r in per_night]
            for metric, _ in TREND_METRICS
        }
        for pair, per_night in rows.items()
    }
    statuses = {
        pair: [None if r is None else r.status for r in per_night]
        for pair, per_night in rows.items()
    }
    return Trend(
        nights=tuple(nights),
        night_times=tuple(times),
        series=series,
        statuses=statuses,
        rows=rows,
        skipped_lines=history.skipped_lines,
    )


def trend_series(history: History) -> tuple[list[str], Series]:
    """(nights, pair -> metric -> value per night): :func:`build_trend` without the rest."""
    trend = build_trend(history)
    return list(trend.nights), trend.series


# -- markdown -------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 10**digits:
        return f"{value:.0f}"  # tokens/s: 1234, not 1.23e+03
    return f"{value:.{digits}g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def _step_time(record: NightRecord, side: str) -> str:
    value = record.step_time_s if side == "test" else record.control_step_time_s
    # '*': wall time / steps, an upper bound (see convergence.nightly.history.step_times)
    wall = value is not None and record.step_time_from.get(side) == "wall"
    return _fmt(value) + ("*" if wall else "")


def _row(night: str, record: NightRecord | None) -> str:
    if record is None:
        return f"| {night} | {ABSENT} | – | – | – | – |"
    return (
        f"| {night} | {record.status} | {_fmt(record.final_loss_delta)} | "
        f"{_fmt(record.control_final_loss, 5)} | "  # a drift of 1e-3 must show
        f"{_step_time(record, 'test')} / {_step_time(record, 'control')} | "
        f"{_fmt(record.tokens_per_s)} / {_fmt(record.control_tokens_per_s)} |"
    )


def _overview(trend: Trend) -> list[str]:
    lines = [
        "| pair | nights run | passed | failed | error | last verdict | per night |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair in trend.pairs():
        statuses = trend.statuses[pair]
        ran = [s for s in statuses if s is not None]
        strip = "".join(ABSENT_MARK if s is None else VERDICT_MARKS.get(s, "?") for s in statuses)
        lines.append(
            f"| {pair} | {len(ran)}/{len(statuses)} | {ran.count('passed')} | "
            f"{ran.count('failed')} | {ran.count('error')} | "
            f"{ran[-1] if ran else '–'} | `{strip}` |"
        )
    marks = ", ".join(f"{m} {s}" for s, m in VERDICT_MARKS.items())
    lines += ["", f"Per night, oldest first: {marks}, {ABSENT_MARK} did not run."]
    return lines


def render_trend_markdown(
    history: History | Trend, *, plots: tuple[str, ...] = (), tensorboard: str | None = None
) -> str:
    """The trend as markdown; ``plots`` are PNG names relative to the markdown's folder
    (default: the standard set), ``tensorboard`` the TensorBoard folder likewise."""
    trend = history if isinstance(history, Trend) else build_trend(history)
    nights = trend.nights
    lines = [f"# Convergence trend ({len(nights)} nights: {nights[0]} … {nights[-1]})", ""]
    if trend.skipped_lines:
        lines += [f"{trend.skipped_lines} unreadable history line(s) skipped.", ""]
    for name in plots or tuple(spec.file for spec in PLOTS):
        title = next((s.title for s in PLOTS if s.file == name), name)
        alt = "trend" if name == "trend.png" else title
        lines += [f"![{alt}]({name})", ""]
    if tensorboard:
        lines += [
            f"TensorBoard (one run per pair, the night's index as the step): "
            f"`tensorboard --logdir {tensorboard}`",
            "",
        ]
    lines += ["## Overview", "", *_overview(trend), ""]
    for pair in trend.pairs():
        lines += [
            f"## {pair}",
            "",
            "| night | verdict | final loss Δ | control final loss | step time (s) | tokens/s |",
            "|---|---|---|---|---|---|",
        ]
        rows = zip(nights, trend.rows[pair], strict=False)
        lines += [_row(night, record) for night, record in rows]
        lines.append("")
    wall_marked = any(
        r is not None and "wall" in r.step_time_from.values()
        for per_night in trend.rows.values()
        for r in per_night
    )
    lines.append(
        "Step time and tokens/s: test / control. Final loss Δ: test − control at the "
        "last step both logged."
    )
    if wall_marked:
        lines += [
            "",
            "\\* wall time / steps (the run's meta had no tokens per step): includes "
            "start-up, an upper bound.",
        ]
    lines.append("")
    return "\n".join(lines)


# -- json and the files ---------------------------------------------------------------------


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc).isoformat()


def trend_json(
    trend: Trend, *, plots: tuple[str, ...] = (), tensorboard: dict[str, str] | None = None
) -> dict[str, object]:
    return {
        "nights": list(trend.nights),
        "night_times": [_iso(t) for t in trend.night_times],
        "pairs": {
            pair: {
                "status": trend.statuses[pair],
                **{m: [json_num(v) for v in vs] for m, vs in per.items()},
            }
            for pair, per in sorted(trend.series.items())
        },
        "plots": list(plots),
        "tensorboard": dict(tensorboard or {}),
        "skipped_lines": trend.skipped_lines,
    }


@dataclass(frozen=True, kw_only=True)
class TrendFiles:
    markdown: Path
    json: Path
    png: Path
    """trend.png: the final loss Δ, one panel per pair."""
    pngs: tuple[Path, ...] = ()
    """Every PNG written, trend.png first."""
    tensorboard: dict[str, Path] = field(default_factory=dict)
    """pair -> its TensorBoard run folder."""
    series: Series = field(default_factory=dict)
    """pair -> metric -> value per night (None where the pair did not run)."""


def write_trend(history_path: Path, out: Path) -> TrendFiles:
    trend = build_trend(read_history(history_path))
    out.mkdir(parents=True, exist_ok=True)
    pngs = tuple(
        plot_trend_panels(trend.nights, trend.series, trend.statuses, spec, out / spec.file)
        for spec in PLOTS
    )
    runs = export_tensorboard(trend.nights, trend.night_times, trend.series, out / "tensorboard")
    names = tuple(p.name for p in pngs)
    md = out / "trend.md"
    md.write_text(
        render_trend_markdown(trend, plots=names, tensorboard="tensorboard"), encoding="utf-8"
    )
    js = out / "trend.json"
    relative = {pair: path.relative_to(out).as_posix() for pair, path in runs.items()}
    js.write_text(
        json.dumps(trend_json(trend, plots=names, tensorboard=relative), indent=2), encoding="utf-8"
    )
    return TrendFiles(
        markdown=md, json=js, png=pngs[0], pngs=pngs, tensorboard=runs, series=trend.series
    )

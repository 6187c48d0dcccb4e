"""PNG plots: one figure per pair (loss, residual, grad norm) and a heatmap over all pairs,
and the file names they get in the report's plot folder.

Figures come from :func:`convergence.report.figure.new_figure` (Agg canvas, never pyplot;
~0.3 s per figure); matplotlib itself is imported lazily, inside the functions that draw.
Every panel copes with a missing metric or side (errored pairs still get a figure).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from convergence.report.data.curves import (
    aligned_delta,
    curve_of_test,
    reference_curve,
    replicate_band,
)
from convergence.report.data.records import (
    first_divergent_step,
    layout_record,
    techniques_changed,
)
from convergence.report.data.resume import resume_record
from convergence.report.figure import new_figure, save_png
from convergence.report.files import atomic_write, slug
from convergence.report.fmt import VERDICTS, describe_test
from convergence.report.formats.plot_cache import cached_plot
from convergence.report.sections.dimensions import ChangeRecord, dimension_of
from convergence.run.outcome import PairOutcome
from convergence.stats.types import MetricVerdict

if TYPE_CHECKING:
    from matplotlib.axes import Axes

CONTROL_COLOR = "#1f77b4"
TEST_COLOR = "#ff7f0e"
DIVERGE_COLOR = "#d62728"
PLOT_DIR = "plots"
"""The plot folder, inside the report folder."""
HEATMAP = "heatmap"


def plot_names(outcomes: Iterable[PairOutcome]) -> dict[str, str]:
    """A unique, file-system-safe stem per pair id (two files may hold the same test name)."""
    names: dict[str, str] = {}
    used: set[str] = {HEATMAP}
    for o in outcomes:
        base = slug(o.pair.pair_id)
        name, i = base, 2
        while name in used:
            name, i = f"{base}-{i}", i + 1
        used.add(name)
        names[o.pair.pair_id] = name
    return names


def _note(ax: Axes, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="0.4",
        fontsize=10,
        wrap=True,
    )


def tolerance_envelope(
    verdict: MetricVerdict | None, steps: npt.NDArray[np.int64], reference: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
    """The allowed Δ per step (lowest, highest): the verdict's band minus the reference.

    The band is what the verdict held the test to, whatever the method (paired, allclose,
    seed, a new one), so nothing here re-derives a tolerance. Steps the band does not cover
    get NaN (a gap). Verdicts without a band (exact; outcomes saved before verdicts carried
    one) fall back to the constant ``tolerance_at_max``.
    """
    if verdict is None:
        return None
    band = verdict.band
    if band is not None and band.steps:
        band_steps = np.asarray(band.steps, dtype=np.int64)
        at = np.clip(np.searchsorted(band_steps, steps), 0, band_steps.size - 1)
        covered = band_steps[at] == steps
        lower = np.where(covered, np.asarray(band.lower)[at], np.nan)
        upper = np.where(covered, np.asarray(band.upper)[at], np.nan)
        return lower - reference, upper - reference
    if verdict.tolerance_at_max is not None and math.isfinite(verdict.tolerance_at_max):
        half = np.full(steps.shape, float(verdict.tolerance_at_max))
        return -half, half
    return None


def _mark_divergence(ax: Axes, step: int | None, metric: str) -> None:
    """The panel's own metric's first divergent step, named (the title's step is the
    earliest over every failing metric, which may be another one)."""
    if step is not None:
        ax.axvline(
            step,
            color=DIVERGE_COLOR,
            linestyle="--",
            linewidth=1.2,
            label=f"{metric} first diverges (step {step})",
        )


def _mark_resume(ax: Axes, outcome: PairOutcome, *, label: bool) -> None:
    """A resuming test side: a dotted line between its checkpoint step K and K+1."""
    resume = outcome.pair.test.resume
    if resume is not None:
        ax.axvline(
            resume.at_step + 0.5,
            color="0.35",
            linestyle=":",
            linewidth=1.2,
            label=(f"resume after step {resume.at_step} ({resume.layout.short_name()})")
            if label
            else None,
        )


def _curves_panel(ax: Axes, outcome: PairOutcome, metric: str, title: str) -> bool:
    """Control (or replicate band) and test curves of ``metric``; False when neither exists."""
    band = replicate_band(outcome, metric)
    ctrl = reference_curve(outcome, metric)
    test = curve_of_test(outcome, metric)
    ax.set_title(title, loc="left", fontsize=10)
    if ctrl is None and test is None:
        _note(ax, f"no {metric} curve")
        return False
    if band is not None:
        ax.fill_between(
            band.steps,
            band.center - band.half_width,
            band.center + band.half_width,
            color=CONTROL_COLOR,
            alpha=0.2,
            linewidth=0,
            label=band.label or f"control band (z {band.z:g}, {band.num_replicates} seeds)",
        )
        ax.plot(
            band.steps,
            band.center,
            color=CONTROL_COLOR,
            linewidth=1.4,
            label="control mean" if band.label else "control smoothed mean",
        )
    elif ctrl is not None:
        # Wide under the narrow test line: two agreeing curves both stay visible.
        ax.plot(
            ctrl.steps,
            ctrl.values,
            color=CONTROL_COLOR,
            linewidth=3.0,
            alpha=0.7,
            label=f"control ({outcome.pair.control.layout.short_name()})",
        )
    if test is not None:
        ax.plot(
            test.steps,
            test.values,
            color=TEST_COLOR,
            linewidth=1.2,
            linestyle="-",
            label=f"test ({outcome.pair.test.layout.short_name()})",
        )
    verdict = outcome.verdict(metric)
    _mark_divergence(ax, verdict.first_divergent_step if verdict else None, metric)
    _mark_resume(ax, outcome, label=True)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    return True


def _residual_panel(ax: Axes, outcome: PairOutcome, metric: str) -> None:
    band = replicate_band(outcome, metric)
    reference = "control band centre" if band is not None else "control"
    ax.set_title(f"residual: test − {reference} ({metric})", loc="left", fontsize=10)
    found = aligned_delta(outcome, metric)
    ref = reference_curve(outcome, metric)
    if found is None or ref is None:
        _note(ax, "no common steps to compare")
        return
    steps, delta = found
    verdict = outcome.verdict(metric)
    ref_values = ref.values[np.searchsorted(ref.steps, steps)]
    envelope = tolerance_envelope(verdict, steps, ref_values)
    if envelope is not None:
        lower, upper = envelope
        exact = verdict is not None and verdict.band is not None and bool(verdict.band.steps)
        label = (
            (band.label or f"band (z {band.z:g})")
            if band is not None
            else "tolerance"
            if exact
            else "tolerance (at max)"
        )
        ax.fill_between(steps, lower, upper, color="0.6", alpha=0.3, linewidth=0, label=f"±{label}")
        _symlog_if_far(ax, delta, np.fmax(np.abs(lower), np.abs(upper)))
    color = DIVERGE_COLOR if verdict is not None and not verdict.passed else "0.15"
    marker = "." if steps.size <= 200 else None  # dots help on short runs, smear long ones
    ax.plot(steps, delta, color=color, linewidth=1.2, marker=marker, markersize=3, label="Δ")
    _twin_residual(ax, outcome, metric)
    ax.axhline(0, color="0.5", linewidth=0.6)
    _mark_divergence(ax, verdict.first_divergent_step if verdict else None, metric)
    if ax.get_yscale() == "linear":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)


def _twin_residual(ax: Axes, outcome: PairOutcome, metric: str) -> None:
    """Twin regime: twin - control, the legitimate noise the envelope was sized from."""
    twins = outcome.control.twins if outcome.control is not None else ()
    twin = twins[0] if twins else None  # the noise twin
    control = outcome.control.metrics.get(metric) if outcome.control is not None else None
    if twin is None or control is None or metric not in twin:
        return
    steps, ci, ti = np.intersect1d(control.steps, twin[metric].steps, return_indices=True)
    ax.plot(
        steps,
        twin[metric].values[ti] - control.values[ci],
        color=CONTROL_COLOR,
        linewidth=1.0,
        linestyle="--",
        label="twin − control (noise)",
    )


def _symlog_if_far(ax: Axes, delta: npt.NDArray[np.float64], half: npt.NDArray[np.float64]) -> None:
    """A diverged residual can be 1e5x the tolerance; on a linear axis the envelope vanishes.

    Symlog keeps the envelope linear (|y| < tolerance) and the divergence logarithmic.
    """
    finite_d = np.abs(delta[np.isfinite(delta)])
    finite_h = half[np.isfinite(half) & (half > 0)]
    if finite_d.size == 0 or finite_h.size == 0:
        return
    limit = float(finite_h.max())
    top = float(finite_d.max())
    if top <= 20 * limit:
        return
    ax.set_yscale("symlog", linthresh=limit, linscale=1.0)
    # Explicit ticks: the default symlog ticks pile up (and overlap) inside the linear part.
    decades = [
        10.0**k for k in range(math.floor(math.log10(limit)) + 1, math.ceil(math.log10(top)) + 1)
    ]
    decades = [d for d in decades if d >= 5 * limit]  # none crowding the tolerance's tick
    decades = decades[::-1][:: max(1, len(decades) // 5)]
    ticks = sorted(
        {0.0, limit, -limit, *decades, *(-d for d in decades if float(np.nanmin(delta)) < -limit)}
    )
    ax.set_yticks(ticks, [f"{t:.0e}" if t else "0" for t in ticks])
    ax.minorticks_off()
    ax.set_title(
        ax.get_title(loc="left") + "  [symlog: linear within the tolerance]",
        loc="left",
        fontsize=10,
    )


def _title(outcome: PairOutcome) -> str:
    status = VERDICTS.get(outcome.status, outcome.status.upper())
    pair = outcome.pair
    test = describe_test(pair.test.layout.short_name(), techniques_changed(outcome))
    text = (
        f"{pair.name} — {status}   control {pair.control.layout.short_name()} "
        f"vs test {test} ({pair.regime} regime)"
    )
    step = first_divergent_step(outcome)
    if step is not None:
        # Which metric: the panels mark each their own metric's step, and a pair whose grad
        # norm parts at step 8 and loss at 11 read "diverges at step 8" over "step 11" lines.
        metrics = [
            v.metric
            for v in outcome.verdicts
            if v.gate and not v.passed and v.first_divergent_step == step
        ]
        text += f", first diverges at step {step} ({', '.join(metrics)})"
    return text


GRADIENT_LABELS = {
    "grad_norm": "grad norm",
    "grad_norm_parts": "per-part grad norm",
    "update_norm_parts": "per-part update norm",
}


def _gradient_metric(outcome: PairOutcome) -> str:
    """The gradient curve worth the third panel: the total grad norm when it failed, else the
    first of the per-part grad norm (a bug in one kind of weight, invisible in the total) and
    the per-part update norm (a bug after the gradient: clipping, LR, optimizer) that failed,
    else the total."""
    total = outcome.verdict("grad_norm")
    if total is None or total.passed:
        for metric in ("grad_norm_parts", "update_norm_parts"):
            verdict = outcome.verdict(metric)
            if verdict is not None and not verdict.passed and verdict.gate:
                return metric
    return "grad_norm"


def plot_pair(outcome: PairOutcome, path: Path) -> Path:
    """Loss (with band / divergence), residual with tolerance envelope, grad norm."""
    fig = new_figure(9.0, 8.0)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=[1.3, 1.0, 1.0])
    fig.subplots_adjust(left=0.09, right=0.98, top=0.94, bottom=0.07, hspace=0.28)
    colour = {"passed": "#1a7f37", "failed": DIVERGE_COLOR}.get(outcome.status, "0.3")
    fig.suptitle(_title(outcome), fontsize=11, color=colour)
    _curves_panel(axes[0], outcome, "loss", "loss")
    _residual_panel(axes[1], outcome, "loss")
    _mark_resume(axes[1], outcome, label=False)
    gradient = _gradient_metric(outcome)
    _curves_panel(axes[2], outcome, gradient, GRADIENT_LABELS[gradient])
    axes[2].set_xlabel("step")
    from matplotlib.ticker import MaxNLocator  # lazy, like every matplotlib import here

    # Steps are whole numbers: no 2.5 ticks on a short run (the axes share x).
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    if outcome.error:
        axes[0].text(
            0.01,
            0.03,
            "error: " + outcome.error.strip().splitlines()[0][:110],
            transform=axes[0].transAxes,
            fontsize=8,
            color=DIVERGE_COLOR,
            va="bottom",
        )
    for ax in axes:
        _pin_title(ax)
    return save_png(fig, path)


def _pin_title(ax: Axes) -> None:
    """Pin a panel's title where matplotlib would put it when nothing is above the axes.

    An automatic title position measures the y axis's tick labels at every draw, a third of a
    figure's time; it only moves the title when the y axis shows an offset text ("1e-5") at its
    top, which is told here from the tick locations alone (no tick is built). Called when the
    panel is complete: asking for the ticks settles the view limits.
    """
    formatter = ax.yaxis.get_major_formatter()
    formatter.set_locs(list(ax.yaxis.get_majorticklocs()))
    if not formatter.get_offset():
        ax.set_title(ax.get_title(loc="left"), loc="left", fontsize=10, y=1.0)


# -- heatmap ----------------------------------------------------------------------------------
def dimension(outcome: PairOutcome) -> str:
    """What the pair verifies, named as the "By dimension" table names it (``+tp2``,
    ``+cp2 +ac:full``, ``-rep2+shard2``): the heatmap's row groups are that table's rows."""
    change: ChangeRecord = {
        "control": layout_record(outcome.pair.control),
        "test": layout_record(outcome.pair.test),
        "techniques_changed": techniques_changed(outcome),
    }
    resume = resume_record(outcome, None)
    if resume is not None:
        change["resume"] = resume
    return dimension_of(change)


def _heat_metrics(outcomes: Sequence[PairOutcome]) -> list[str]:
    seen: list[str] = []
    for o in outcomes:
        for v in o.verdicts:
            if (v.gate or v.not_compared) and v.metric not in seen:
                seen.append(v.metric)
    return seen or ["loss"]


def _cell(outcome: PairOutcome, metric: str) -> tuple[float, str]:
    """(log10 of max|Δ| / tolerance, annotation); NaN colour means no number to show."""
    if outcome.status == "error":
        return math.nan, "ERROR"
    verdict = outcome.verdict(metric)
    if verdict is None:
        return math.nan, "-"
    if verdict.not_compared:  # a gating metric a run did not log: grey, never PASS
        return math.nan, "not\ncompared"
    word = "PASS" if verdict.passed else "FAIL"
    dev, tol = verdict.max_deviation, verdict.tolerance_at_max
    label = f"{word}\n{dev:.1e}" if math.isfinite(dev) else f"{word}\nnan"
    if not math.isfinite(dev):
        return 3.0, label
    stated = verdict.details.get("max_ratio") if verdict.details else None
    if isinstance(stated, (int, float)) and math.isfinite(stated):
        ratio = float(stated)  # the paired method's own worst |Δ|/tolerance over all steps
    elif tol is None or not math.isfinite(tol) or tol <= 0:
        return (-1.0 if verdict.passed else 1.0), label
    else:
        ratio = dev / tol
    ratio = max(ratio, 1e-300)
    return float(np.clip(np.log10(ratio), -3, 3)), label


def plot_heatmap(outcomes: Sequence[PairOutcome], path: Path) -> Path:
    """One heatmap of every pair x every gating metric (not one per dimension): rows are
    pairs, grouped (and labelled) by the dimension they verify; columns are gating metrics.

    Colour is max|Δ| in units of the tolerance on a log scale (blue well inside, white at the
    tolerance, red beyond) so one glance shows which pair failed and by how much.
    """
    from matplotlib import colormaps

    ordered = sorted(outcomes, key=lambda o: (dimension(o), o.pair.name))
    metrics = _heat_metrics(ordered)
    cells = [[_cell(o, m) for m in metrics] for o in ordered]
    data = np.array([[c[0] for c in row] for row in cells], dtype=float).reshape(
        len(ordered), len(metrics)
    )
    labels = [f"{dimension(o)} │ {o.pair.name}" for o in ordered]
    label_in = 0.3 + 0.075 * max((len(t) for t in labels), default=4)  # ~ 10 pt characters
    width, height = label_in + 1.5 * len(metrics) + 1.4, 1.5 + 0.45 * max(len(ordered), 1)
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    fig.subplots_adjust(
        left=label_in / width, right=1 - 1.3 / width, top=1 - 0.95 / height, bottom=0.15 / height
    )
    cmap = colormaps["RdBu_r"].with_extremes(bad="0.82")
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=-3, vmax=3, aspect="auto")
    ax.set_xticks(range(len(metrics)), metrics)
    ax.set_yticks(range(len(ordered)), labels)
    ax.xaxis.tick_top()
    for i, row in enumerate(cells):
        for j, (value, label) in enumerate(row):
            dark = math.isfinite(value) and abs(value) > 1.8
            ax.text(
                j,
                i,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if dark else "black",
            )
    groups = [dimension(o) for o in ordered]
    for i in range(1, len(groups)):
        if groups[i] != groups[i - 1]:
            ax.axhline(i - 0.5, color="black", linewidth=1.5)
    bar = fig.colorbar(
        image, cax=fig.add_axes((1 - 1.1 / width, 0.15 / height, 0.15 / width, 1 - 0.9 / height))
    )
    bar.set_label("log10(max|Δ| / tolerance)", fontsize=8)
    ax.set_title(
        "max |Δ| / tolerance, each pair × gating metric\n(rows grouped by dimension; "
        "grey: error / not compared)",
        fontsize=10,
    )
    return save_png(fig, path)


def plot_outcomes(
    outcomes: Sequence[PairOutcome],
    plot_dir: Path,
    names: dict[str, str],
    cache_dir: Path | None = None,
) -> tuple[dict[str, Path], dict[str, str]]:
    """Plot every pair into ``plot_dir/<names[pair_id]>.png`` (copying a plot drawn during the
    session from ``cache_dir`` where there is one: plot_cache.py).

    Returns (paths by pair id, errors by pair id): a plotting bug in one pair is reported in
    the report instead of losing the whole report.
    """
    paths: dict[str, Path] = {}
    errors: dict[str, str] = {}
    for o in outcomes:
        pid = o.pair.pair_id
        try:
            drawn = cached_plot(cache_dir, o)
            target = plot_dir / f"{names[pid]}.png"
            if drawn is not None:
                paths[pid] = atomic_write(target, drawn.read_bytes())
                continue
            paths[pid] = plot_pair(o, target)
        except Exception as exc:  # noqa: BLE001 - see docstring
            errors[pid] = f"{type(exc).__name__}: {exc}"
    return paths, errors

"""Pinned panel titles (issue 30: cheaper plots) draw the very PNG the automatic position does.

plots._pin_title skips matplotlib's per-draw title placement where it would not move the title;
where the y axis shows an offset text ("1e-5", the residual panel) it must leave it automatic.
Every example outcome (passing, failing with a symlog residual, errored, seed band) is drawn
both ways and compared byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from report_examples import all_examples

from convergence.report.formats import plots


def test_pinned_titles_give_the_same_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = all_examples()
    for o in outcomes:
        plots.plot_pair(o, tmp_path / f"pinned-{o.pair.name}.png")
    monkeypatch.setattr(plots, "_pin_title", lambda ax: None)
    for o in outcomes:
        plots.plot_pair(o, tmp_path / f"auto-{o.pair.name}.png")
    for o in outcomes:
        pinned = (tmp_path / f"pinned-{o.pair.name}.png").read_bytes()
        assert pinned == (tmp_path / f"auto-{o.pair.name}.png").read_bytes(), o.pair.name


def test_the_title_names_the_metric_of_its_step_and_each_panel_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 52: the title said "diverges at step 8" (the earliest failing metric, unnamed)
    while the loss panels marked "first divergence (step 11)". The title names the metric its
    step is of; each panel's line names the panel's metric."""
    import dataclasses

    import numpy as np
    from report_examples import DIVERGES_AT, STEPS, _side, judge, run_metrics

    from convergence.report import figure

    base = all_examples()[1]  # the failing FSDP2+PP2 pair
    steps = np.arange(1, STEPS + 1)
    grad_from, loss_from = DIVERGES_AT - 6, DIVERGES_AT
    shift = np.where(steps >= loss_from, 2e-3 * (steps - loss_from + 1), 0.0)
    scale = np.where(steps >= grad_from, 2.0, 1.0)
    control, test = run_metrics(1), run_metrics(1, loss_shift=shift, gnorm_scale=scale)
    verdicts = judge(base.pair, [control], test)
    by_metric = {v.metric: v.first_divergent_step for v in verdicts if not v.passed}
    assert by_metric == {"grad_norm": grad_from, "loss": loss_from}, by_metric
    outcome = dataclasses.replace(
        base,
        verdicts=verdicts,
        control=_side(base.pair.control, control),
        test=_side(base.pair.test, test),
    )
    figures = []
    real_save = figure.save_png

    def keep(fig, path):  # type: ignore[no-untyped-def]
        figures.append(fig)
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save_png", keep)
    plots.plot_pair(outcome, tmp_path / "p.png")
    (fig,) = figures
    title = fig._suptitle.get_text()
    assert f"first diverges at step {grad_from} (grad_norm)" in title, title
    loss_panel, residual, grad_panel = fig.axes
    labels = [
        [line.get_label() for line in ax.get_lines() if "diverges" in str(line.get_label())]
        for ax in (loss_panel, residual, grad_panel)
    ]
    assert labels == [
        [f"loss first diverges (step {loss_from})"],
        [f"loss first diverges (step {loss_from})"],
        [f"grad_norm first diverges (step {grad_from})"],
    ], labels

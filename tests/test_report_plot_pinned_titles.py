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

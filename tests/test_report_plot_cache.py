"""Pair plots drawn during the session are the ones the report would draw (issue 30).

The report copies a plot drawn ahead (convergence/report/formats/plot_cache.py) instead of
drawing it again at the end of the session; these tests check that this can never change a
report: the key survives the outcome's JSON round trip (the controller of an xdist session
reads the workers' outcomes back from JSON), and the copied PNGs are byte for byte the drawn
ones.
"""

from __future__ import annotations

from pathlib import Path

from report_examples import all_examples

from convergence.report import outcome_from_json, outcome_to_json, write_reports
from convergence.report.formats.plot_cache import cached_plot, plot_key
from convergence.report.formats.prerender import PlotPrerenderer

ENV = {"python": "3", "torch": "x", "hostname": "h"}


def test_the_key_survives_the_outcomes_json_round_trip() -> None:
    outcomes = all_examples()
    keys = {plot_key(o) for o in outcomes}
    assert len(keys) == len(outcomes)  # different outcomes, different plots
    for o in outcomes:
        assert plot_key(outcome_from_json(outcome_to_json(o))) == plot_key(o), o.pair.pair_id


def test_plots_drawn_ahead_are_the_reports_plots_byte_for_byte(tmp_path: Path) -> None:
    outcomes = all_examples()
    cache = tmp_path / "cache"
    cache.mkdir()
    ahead = PlotPrerenderer(cache)
    for o in outcomes:
        ahead.submit(o)
    ahead.wait()
    assert all(cached_plot(cache, o) is not None for o in outcomes)

    drawn = write_reports(outcomes, tmp_path / "drawn", environment=ENV)
    copied = write_reports(outcomes, tmp_path / "copied", environment=ENV, plot_cache=cache)
    names = sorted(p.name for p in drawn["plots"].glob("*.png"))
    assert names == sorted(p.name for p in copied["plots"].glob("*.png"))
    for name in names:
        assert (drawn["plots"] / name).read_bytes() == (copied["plots"] / name).read_bytes()


def test_the_report_takes_the_cached_plot_rather_than_drawing(tmp_path: Path) -> None:
    """A cached entry is used as it is: proof that the end of the session draws nothing for a
    pair drawn ahead (the entry's bytes here are not a plot at all)."""
    outcome = all_examples()[0]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"{plot_key(outcome)}.png").write_bytes(b"drawn during the session")
    paths = write_reports([outcome], tmp_path / "report", environment=ENV, plot_cache=cache)
    pngs = [p for p in paths["plots"].glob("*.png") if p.name != paths["heatmap"].name]
    assert [p.read_bytes() for p in pngs] == [b"drawn during the session"]

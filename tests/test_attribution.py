"""Which axis broke it (convergence/run/attribution.py): the search over lower-dimensional
pairs, then a real 2-axis pair on CPU/gloo whose bug lives only in TP x CP."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from convergence.run.attribution import (
    attribute,
    attribution_on,
    label,
    layout_axes,
    needs_attribution,
    sub_layout,
)
from convergence.run.outcome import PairOutcome
from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout
from experiments import builtin_pair

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).parent / "fixtures" / "hooks"
FOUR_D = ParallelLayout(dp_shard=2, tp=2, sequence_parallel=True, cp=2, pp=2)


def _pair(folder: Path, layout: ParallelLayout):  # type: ignore[no-untyped-def]
    """A checked pair whose test side is replaced by ``layout`` (nothing runs)."""
    from convergence.preflight import load_checked

    path = builtin_pair(
        folder,
        file="a.toml",
        steps=4,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "nd", "parallelism": {"dp_shard": 2, "tp": 2}}],
    )
    pair = load_checked(path, rootdir=ROOT).pairs[0]
    return dataclasses.replace(pair, test=dataclasses.replace(pair.test, layout=layout))


def _runner(bad: set[frozenset[str]], calls: list[str]):  # type: ignore[no-untyped-def]
    """A pair "fails" when its layout holds every axis of a bad combination."""

    def run(pair):  # type: ignore[no-untyped-def]
        axes = set(layout_axes(pair.test.layout))
        calls.append(label(layout_axes(pair.test.layout)))
        failed = any(combo <= axes for combo in bad)
        return PairOutcome(
            pair=pair, status="failed" if failed else "passed", control=None, test=None
        )

    return run


def test_sub_layouts_keep_the_dp_degree_and_drop_only_the_named_axes() -> None:
    assert layout_axes(FOUR_D) == ("tp", "sp", "cp", "pp")
    cp = sub_layout(FOUR_D, ["cp"])
    assert (cp.dp_shard, cp.tp, cp.sequence_parallel, cp.cp, cp.pp) == (2, 1, False, 2, 1)
    tp = sub_layout(FOUR_D, ["tp"])
    assert (tp.tp, tp.sequence_parallel, tp.cp) == (2, False, 1)
    assert label(("tp", "sp", "cp")) == "TP+SP x CP"


def test_a_cp_only_bug_in_a_4d_pair_names_cp_alone_after_the_singles(tmp_path: Path) -> None:
    calls: list[str] = []
    record = attribute(_pair(tmp_path, FOUR_D), run=_runner({frozenset({"cp"})}, calls))
    assert record["blame"] == "CP alone"
    assert calls == ["TP", "CP", "PP"]  # the singles (SP only with TP): then it stops
    assert "CP: fail" in record["summary"] and record["jobs"] == 3


def test_an_interaction_is_named_by_the_smallest_failing_combination(tmp_path: Path) -> None:
    three = ParallelLayout(dp_shard=2, tp=2, cp=2, pp=2)
    calls: list[str] = []
    record = attribute(_pair(tmp_path, three), run=_runner({frozenset({"tp", "cp"})}, calls))
    assert record["blame"] == "an interaction of TP and CP"
    assert calls == ["TP", "CP", "PP", "TP x CP", "TP x PP", "CP x PP"]
    # Every axis passes alone and every pair of them too: the whole combination is to blame.
    record = attribute(_pair(tmp_path, three), run=_runner({frozenset({"tp", "cp", "pp"})}, []))
    assert record["blame"] == "an interaction of TP, CP and PP"


def test_a_sub_pair_that_cannot_run_is_named_and_leaves_the_blame_undetermined(
    tmp_path: Path,
) -> None:

    def refuse_pp(pair):  # type: ignore[no-untyped-def]
        if pair.test.layout.pp > 1:
            raise SpecError("too few devices for pp", file="a.toml", key="test.parallelism")
        return pair

    two = ParallelLayout(dp_shard=2, tp=2, pp=2)
    record = attribute(
        _pair(tmp_path, two), run=_runner({frozenset({"tp", "pp"})}, []), prepare=refuse_pp
    )
    assert record["blame"].startswith("undetermined")
    assert [r["status"] for r in record["runs"]] == ["passed", "not run"]


def test_only_failed_multi_axis_pairs_are_attributed_and_nightly_does_by_default(
    tmp_path: Path,
) -> None:
    two = _pair(tmp_path, ParallelLayout(dp_shard=2, tp=2, cp=2))
    one = _pair(tmp_path, ParallelLayout(dp_shard=2, tp=2))
    assert needs_attribution(PairOutcome(pair=two, status="failed", control=None, test=None))
    assert not needs_attribution(PairOutcome(pair=two, status="passed", control=None, test=None))
    assert not needs_attribution(PairOutcome(pair=two, status="error", control=None, test=None))
    assert not needs_attribution(PairOutcome(pair=one, status="failed", control=None, test=None))
    assert attribution_on(asked=False, tier="nightly") and attribution_on(asked=True, tier="ci")
    assert not attribution_on(asked=False, tier="ci")


@pytest.mark.rounding
def test_a_bug_only_in_tp_x_cp_is_reported_as_their_interaction(tmp_path: Path) -> None:
    """Real jobs: control single rank, test TP2 x CP2 (4 ranks) with a bug that exists only
    when both are on; TP2 alone and CP2 alone run against the cached control and pass."""
    from convergence.preflight import load_checked
    from convergence.report.data.records import pair_record
    from convergence.report.formats.failure_text import render_outcome
    from convergence.report.formats.terminal import render_matrix
    from convergence.run.attribution import attribute_failed
    from convergence.run.runner import Runner, RunSettings

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p
    )
    sys.path.insert(0, str(HOOKS))
    path = builtin_pair(
        tmp_path / "exp",
        file="axes.toml",
        steps=4,
        seed=5,
        control={"name": "single", "parallelism": {"dp_shard": 1}},
        tests=[
            {
                "name": "tp2-cp2",
                "parallelism": {"dp_shard": 1, "tp": 2, "cp": 2},
                "hook": "planted_axis_bugs:only_with_tp_and_cp",
                "probe": "off",
            }
        ],
    )
    pair = load_checked(path, rootdir=ROOT).pairs[0]
    runner = Runner(RunSettings(work_dir=tmp_path / "work", idle_limit_s=180, wall_limit_s=600))
    outcome = runner.run_pair(pair)
    assert outcome.status == "failed", (outcome.error, [v.message for v in outcome.verdicts])
    attributed = attribute_failed(outcome, run=runner.run_pair, devices=8)
    record = attributed.attribution
    assert record is not None
    assert [(r["label"], r["status"]) for r in record["runs"]] == [
        ("TP", "passed"),
        ("CP", "passed"),
    ], record
    assert record["blame"] == "an interaction of TP and CP"
    assert record["summary"] == ("TP: pass; CP: pass; TP x CP: fail -> an interaction of TP and CP")
    # The pair's own verdict stands; the reports carry the blame.
    assert attributed.status == "failed" and attributed.verdicts == outcome.verdicts
    assert pair_record(attributed)["attribution"]["blame"] == record["blame"]
    assert "attribution (which axis): TP: pass; CP: pass" in render_outcome(attributed)
    assert "an interaction of TP and CP" in render_matrix([attributed], width=200)

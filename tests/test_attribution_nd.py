"""Attribution on trained 3-D and 4-D pairs (real torchrun jobs, CPU/gloo, the debug model):
a bug planted only in TP x CP on FSDP2+TP2+CP2 (8 ranks) is named their interaction; a CP-only
bug on FSDP2+TP2+CP2+PP2 (16 ranks) is named CP alone after the singles; the correct 4-D pair
passes and runs no isolating pair. One control (FSDP2, 2 ranks) for all three, from the run
cache after the first. Slow (16 ranks on a small CPU): see BENCHMARKS.md "Attribution and
selftest" for the time and the jobs each costs."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from convergence.run.outcome import PairOutcome
from convergence.spec.pair import PairSpec
from experiments import builtin_pair

pytestmark = [pytest.mark.slow, pytest.mark.rounding, pytest.mark.xdist_group("attribution_nd")]

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).parent / "fixtures" / "hooks"
FOUR_D = {"dp_shard": 2, "tp": 2, "cp": 2, "pp": 2}


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, PairSpec], Callable[[PairSpec], PairOutcome], list[str]]]:
    """The experiment's pairs by name, a run function counting the jobs it starts (pair ids),
    and that list."""
    from convergence.preflight import load_checked
    from convergence.run.runner import Runner, RunSettings

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOKS), old or "") if p)
    sys.path.insert(0, str(HOOKS))
    folder = tmp_path_factory.mktemp("nd")
    path = builtin_pair(
        folder / "exp",
        file="nd.toml",
        steps=3,
        seed=5,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[
            {
                "name": "fsdp2-tp2-cp2",
                "parallelism": {"dp_shard": 2, "tp": 2, "cp": 2},
                "hook": "planted_axis_bugs:only_with_tp_and_cp",
                "probe": "off",
            },
            {
                "name": "4d-cp-bug",
                "parallelism": FOUR_D,
                "hook": "planted_axis_bugs:only_with_cp",
                "probe": "off",
            },
            {"name": "4d", "parallelism": FOUR_D, "probe": "off"},
        ],
    )
    pairs = {p.name: p for p in load_checked(path, rootdir=ROOT).pairs}
    runner = Runner(
        RunSettings(work_dir=folder / "work", devices=16, idle_limit_s=300, wall_limit_s=900)
    )
    ran: list[str] = []

    def run(pair: PairSpec) -> PairOutcome:
        ran.append(pair.pair_id)
        return runner.run_pair(pair)

    yield pairs, run, ran
    sys.path.remove(str(HOOKS))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def _attributed(
    setup: tuple[dict[str, PairSpec], Callable[[PairSpec], PairOutcome], list[str]], name: str
) -> tuple[PairOutcome, list[str]]:
    from convergence.run.attribution import attribute_failed

    pairs, run, ran = setup
    ran.clear()
    outcome = run(pairs[name])
    attributed = attribute_failed(outcome, run=run, devices=16)
    return attributed, list(ran)


def test_a_3d_pair_with_a_tp_x_cp_bug_is_their_interaction(setup) -> None:  # type: ignore[no-untyped-def]
    outcome, ran = _attributed(setup, "fsdp2-tp2-cp2")
    assert outcome.status == "failed", (outcome.error, [v.message for v in outcome.verdicts])
    record = outcome.attribution
    assert record is not None
    assert [(r["label"], r["layout"], r["status"]) for r in record["runs"]] == [
        ("TP", "fsdp2-tp2", "passed"),
        ("CP", "fsdp2-cp2", "passed"),
    ], record
    assert record["blame"] == "an interaction of TP and CP"
    assert len(ran) == 3 and record["jobs"] == 2  # the pair + two isolating pairs


def test_a_4d_pair_with_a_cp_only_bug_names_cp_alone(setup) -> None:  # type: ignore[no-untyped-def]
    outcome, ran = _attributed(setup, "4d-cp-bug")
    assert outcome.status == "failed", (outcome.error, [v.message for v in outcome.verdicts])
    record = outcome.attribution
    assert record is not None
    assert [(r["label"], r["status"]) for r in record["runs"]] == [
        ("TP", "passed"),
        ("CP", "failed"),
        ("PP", "passed"),
    ], record
    cp = record["runs"][1]
    assert cp["layout"] == "fsdp2-cp2" and cp["first_divergent_step"] == 1, cp
    assert record["blame"] == "CP alone"
    assert len(ran) == 4  # the pair and the three singles: no combination was needed


def test_a_correct_4d_pair_runs_no_attribution(setup) -> None:  # type: ignore[no-untyped-def]
    outcome, ran = _attributed(setup, "4d")
    assert outcome.status == "passed", (outcome.error, [v.message for v in outcome.verdicts])
    assert outcome.attribution is None and len(ran) == 1

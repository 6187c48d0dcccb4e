"""A fourth regime is this test module plus one registration line.

``LooseRegime`` is a toy: the loss and grad norm within 1% (allclose), one extra control job
(the control on twice the FSDP degree, kept as a replicate for the report), never the default, no
numerics probe, an early stop after one clearly bad step. It is registered by one line --
``registered(LOOSE)`` here, a ``SHIPPED`` entry in convergence/regimes/registry.py for a
shipped one -- and then the experiment parser, the preflight, the device check, the Runner's
control jobs, the probe's eligibility and ``convergence compare`` all know it, without any
other change to the library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_metrics_reader import LOSSES, write_jsonl_run

from convergence.cli import main
from convergence.metrics.curve import RunMetrics
from convergence.preflight import load_checked, validate_devices
from convergence.regimes import ControlCurves, EarlyStopPolicy, TwinSource, registered
from convergence.regimes.base import gating_rules
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import ComparisonRule, Method, PairSpec
from experiments import builtin_pair

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LooseRegime:
    name: str = "loose"
    method: Method = "allclose"
    early_stop: EarlyStopPolicy = EarlyStopPolicy(min_step=1, patience=1)
    probe_on_failure: bool = False
    band_of_replicates: bool = False

    def default_rules(self) -> tuple[ComparisonRule, ...]:
        return tuple(
            dataclasses.replace(r, rtol=1e-2) if r.method == self.method else r
            for r in gating_rules(self.method)
        )

    def claims(self, control: JobSpec, test: JobSpec, *, twins: bool) -> bool:
        return False  # only where an experiment names it

    def check(self, pair: PairSpec, *, key: str, backend: TwinSource) -> None:
        if pair.control.seed != pair.test.seed:
            raise SpecError("loose needs one seed", file=pair.source, key=f"{key}.seed")

    def check_method_use(self, pair: PairSpec, *, key: str) -> None:
        return None

    def control_jobs(self, pair: PairSpec, backend: TwinSource) -> tuple[JobSpec, ...]:
        layout = pair.control.layout
        wide = dataclasses.replace(
            pair.control,
            name=f"{pair.control.name}-wide",
            layout=dataclasses.replace(layout, dp_shard=layout.dp_shard * 2),
        )
        return (pair.control, wide)

    def check_control_runs(self, count: int) -> None:
        return None

    def control_curves(self, runs: Sequence[RunMetrics]) -> ControlCurves:
        return ControlCurves(replicates=tuple(runs))


LOOSE = LooseRegime()


@pytest.fixture
def loose() -> Iterator[LooseRegime]:
    with registered(LOOSE) as regime:  # <- the one registration line
        yield regime


def _experiment(tmp_path: Path, **test: object) -> Path:
    return builtin_pair(
        tmp_path,
        train_config="debug",
        steps=6,
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "fsdp2-again", "parallelism": {"dp_shard": 2}, "regime": "loose", **test}],
    )


def _pair(tmp_path: Path) -> PairSpec:
    (pair,) = load_checked(_experiment(tmp_path), rootdir=ROOT).pairs
    return pair


def test_an_unregistered_regime_is_a_collection_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="unknown regime 'loose'") as err:
        _pair(tmp_path)
    assert err.value.key == "test[0].regime"


def test_the_parser_and_preflight_take_its_rules(tmp_path: Path, loose: LooseRegime) -> None:
    pair = _pair(tmp_path)
    assert pair.regime == "loose"
    loss = pair.rule_for("loss")
    assert loss is not None and (loss.method, loss.rtol) == ("allclose", 1e-2)
    validate_devices(pair, available_devices=4)
    with pytest.raises(SpecError, match=r"control 'fsdp2-wide' \(.*\) needs 4 devices"):
        validate_devices(pair, available_devices=2)  # the control and the test fit, not it


def test_its_own_checks_run_at_collection(tmp_path: Path, loose: LooseRegime) -> None:
    path = _experiment(tmp_path, seed=7)
    with pytest.raises(SpecError, match="loose needs one seed"):
        load_checked(path, rootdir=ROOT)


def test_the_runner_runs_its_control_jobs_and_keeps_its_curves(
    tmp_path: Path, loose: LooseRegime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from convergence.run.outcome import SideOutcome
    from convergence.run.probe import wants_probe
    from convergence.run.runner import Runner, RunSettings

    pair = _pair(tmp_path)
    runner = Runner(RunSettings(work_dir=tmp_path / "work", devices=2))
    ran: list[str] = []

    def run_job(side: str, job: JobSpec, **_: object) -> SideOutcome:
        ran.append(job.name)
        return SideOutcome(job=job, metrics={})

    monkeypatch.setattr(runner.jobs, "run_job", run_job)
    sides = runner._controls(pair, tmp_path / "pair", LOOSE, runner.jobs)
    # Run at once where the pool has room (run/together.py): in any order, kept in order.
    assert sorted(ran) == ["fsdp2", "fsdp2-wide"] and len(sides[0].replicates) == 2
    assert [side.job.name for side in sides] == ["fsdp2", "fsdp2-wide"]
    assert not wants_probe(pair, "failed")  # the regime says no probe


def test_convergence_compare_judges_with_it(
    tmp_path: Path, loose: LooseRegime, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_jsonl_run(tmp_path / "a", LOSSES)
    b = write_jsonl_run(tmp_path / "b", [x * 1.005 for x in LOSSES])  # 0.5%: inside 1%
    assert main(["compare", str(a), str(b), "--regime", "loose"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:3] == ["loss", "allclose", "pass"] for line in out.splitlines())

"""Checks as plug-ins (convergence/checks/): the shipped checks follow the Check Protocol, the
Runner, preflight and the judge reach a check only through it, and a new check is one module
plus a registry entry -- shown with a check written here, run through a real pair."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from convergence.backends.base import Backend
from convergence.checks import ExtraJob, ProbeRequest, Ran, all_checks, checks_of
from convergence.checks import registry as check_registry
from convergence.checks.base import Check
from convergence.preflight import load_checked
from convergence.run.runner import Runner, RunSettings
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec
from convergence.stats.types import MetricVerdict
from experiments import command_pair, fixture_command

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_check_follows_the_protocol() -> None:
    members = {
        name for name, _ in inspect.getmembers(Check) if not name.startswith("_") and name != "mro"
    } | {"name", "replay_probe"}
    assert [c.name for c in all_checks()] == list(check_registry.SHIPPED)
    for check in all_checks():
        missing = {m for m in members if not hasattr(check, m)}
        assert not missing, (check, missing)


def test_the_runner_preflight_and_judge_know_no_check_by_name() -> None:
    """The spine loops over a pair's checks: none of its modules imports a check module or
    a check's statistics (the anchored/resumed verdicts, their jobs)."""
    spine = ["run/runner.py", "run/judge.py", "preflight.py"]
    named = {
        "convergence.checks.resumed",
        "convergence.stats.anchored",
        "convergence.stats.resumed",
        "convergence.checks.anchored",
    }
    for module in spine:
        tree = ast.parse((REPO / "convergence" / module).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & named, (module, imported & named)


class FinalLossCheck:
    """A check of another package: the test's last loss within 1e-3 of the control's, and one
    extra job -- the test layout again -- whose last loss must equal the test's."""

    name = "final_loss"
    replay_probe = True

    keys: Mapping[str, str] = {}

    def validate(self, pair: PairSpec, *, key: str, steps: int | None) -> None:
        return None

    def applies(self, pair: PairSpec) -> bool:
        return pair.test.name.startswith("checked")

    def trajectory_until(self, pair: PairSpec) -> int | None:
        return None

    def refuse(self, pair: PairSpec, backends: Mapping[str, Backend], *, key: str) -> None:
        if pair.test.steps < 2:
            raise SpecError("final_loss needs 2 steps", file=pair.source, key=f"{key}.steps")

    def control_jobs(self, pair: PairSpec, jobs: Sequence[JobSpec]) -> tuple[JobSpec, ...]:
        return tuple(jobs)

    def extra_jobs(self, pair: PairSpec, ran: Ran, backend: Backend) -> tuple[ExtraJob, ...]:
        again = JobSpec(**{**vars(pair.test), "name": f"{pair.test.name}-again"})
        return (ExtraJob("again", "test", again, cacheable=False),)

    def verdicts(
        self, pair: PairSpec, ran: Ran, verdicts: tuple[MetricVerdict, ...]
    ) -> tuple[MetricVerdict, ...]:
        (again,) = ran.of(self.name, "again")
        control = float(ran.controls[0].metrics["loss"].values[-1])
        test = float(ran.test.metrics["loss"].values[-1])
        repeated = float(again.metrics["loss"].values[-1]) == test
        passed = abs(test - control) <= 1e-3 and repeated
        return (
            *verdicts,
            MetricVerdict(
                metric=self.name,
                method="paired",
                passed=passed,
                gate=True,
                steps_compared=1,
                message=f"final_loss: control {control:.6g}, test {test:.6g}, repeated {repeated}",
            ),
        )

    def probe(
        self, pair: PairSpec, verdicts: Sequence[MetricVerdict], ran: Ran
    ) -> ProbeRequest | None:
        return None


@pytest.fixture
def with_final_loss(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """FinalLossCheck registered as another package's entry point would register it."""
    shipped = {**check_registry.SHIPPED, "final_loss": f"{__name__}:FinalLossCheck"}
    monkeypatch.setattr(check_registry, "SHIPPED", shipped)
    check_registry.all_checks.cache_clear()
    yield
    check_registry.all_checks.cache_clear()


def test_a_new_check_is_one_module_and_a_registry_entry(
    tmp_path: Path, with_final_loss: None
) -> None:
    path = command_pair(
        tmp_path,
        command=fixture_command(),
        steps=4,
        tests=[
            {"name": "checked-same"},
            {
                "name": "checked-shifted",
                "backend_options": {"command": fixture_command("--loss-shift-from 4")},
            },
        ],
    )
    pairs = {p.name: p for p in load_checked(path, rootdir=tmp_path).pairs}
    assert [c.name for c in checks_of(pairs["checked-same"])] == ["final_loss"]
    runner = Runner(RunSettings(work_dir=tmp_path / "work", early_stop=False))
    same = runner.run_pair(pairs["checked-same"])
    verdict = same.verdict("final_loss")
    assert same.status == "passed" and verdict is not None and verdict.passed, same.error
    assert "repeated True" in verdict.message
    assert [s.job.name for s in same.extra_sides] == ["checked-same-again"]
    shifted = runner.run_pair(pairs["checked-shifted"])
    verdict = shifted.verdict("final_loss")
    assert verdict is not None and not verdict.passed and shifted.status == "failed"

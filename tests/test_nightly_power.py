"""The weekly selftest in the nightly (convergence/nightly/power.py): when it is due, the rows
in the power history, and a drop in power (a bug caught before and missed now, caught later,
a false alarm) as a drift of ``convergence decide``; the sbatch step that runs it."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from convergence.cli import main
from convergence.nightly.decide import EXIT_CLEAN, EXIT_DRIFT
from convergence.nightly.power import append_power, due, power_drops, read_power
from convergence.nightly.sbatch import NightlySettings, render_sbatch
from experiments import builtin_pair

ROOT = Path(__file__).resolve().parents[1]
WEEK1, WEEK2 = "20261124T200000Z-1", "20261201T200000Z-2"


def _row(bug: str, status: str, step: int | None = None, pair: str = "e::tp2") -> dict[str, Any]:
    return {"pair": pair, "layout": "fsdp2-tp2", "bug": bug, "status": status, "step": step,
            "metric": "grad_norm" if step else None}  # fmt: skip


def test_a_weekly_selftest_is_due_after_a_week_less_half_a_day(tmp_path: Path) -> None:
    power = tmp_path / "power.jsonl"
    assert due(power, "e.toml", every_days=7)  # never ran
    append_power([_row("gradient-2x", "caught", 1)], power, night=WEEK1, experiment="e.toml")
    at = dt.datetime(2026, 11, 24, 20, tzinfo=dt.timezone.utc)
    assert not due(power, "e.toml", every_days=7, now=at + dt.timedelta(days=6))
    assert due(power, "e.toml", every_days=7, now=at + dt.timedelta(days=6, hours=13))
    assert due(power, "other.toml", every_days=7, now=at)  # another experiment: its own week


def test_a_drop_in_power_is_found_only_on_the_night_that_ran_the_selftest(tmp_path: Path) -> None:
    power = tmp_path / "power.jsonl"
    week1 = [_row("(correct)", "passes"), _row("gradient-2x", "caught", 1),
             _row("dp-rank-dropped", "caught", 1), _row("cp-rope-offset", "caught", 2)]  # fmt: skip
    week2 = [_row("(correct)", "FALSE ALARM", 3), _row("gradient-2x", "MISSED"),
             _row("dp-rank-dropped", "caught", 2), _row("cp-rope-offset", "caught", 5)]  # fmt: skip
    append_power(week1, power, night=WEEK1, experiment="e.toml")
    append_power(week2, power, night=WEEK2, experiment="e.toml")
    records = read_power(power)
    texts = sorted(f.text for f in power_drops(records, night=WEEK2, step_slack=2))
    assert len(texts) == 3, texts  # dp-rank-dropped one step later: within the slack
    assert any("gradient-2x caught at step 1 before, MISSED now" in t for t in texts)
    assert any("cp-rope-offset caught at step 5" in t and "3 steps later" in t for t in texts)
    assert any("false-alarms" in t for t in texts)
    assert power_drops(records, night="20261202T200000Z-3") == []  # no selftest that night
    assert power_drops(records, night=WEEK1) == []  # nothing before the first


def _pair_history(path: Path, nights: tuple[str, str]) -> None:
    """Two nights of one green pair, as `convergence record` writes them."""
    with path.open("w") as fh:
        for night in nights:
            fh.write(json.dumps({"night": night, "pair": "e::tp2", "status": "passed"}) + "\n")


@pytest.mark.slow  # two selftests, 5 jobs: 3-6 min on 2 loaded cores
@pytest.mark.rounding
def test_a_bug_the_suite_stops_seeing_is_a_drift_alert(tmp_path: Path) -> None:
    """Two real selftests a week apart on one experiment: the first compares the grad norm and
    catches a doubled gradient at step 1; by the second the experiment compares the loss only,
    which Adam and clipping leave blind to it -- missed, and decide exits with drift."""
    folder, power, work = tmp_path / "user", tmp_path / "power.jsonl", tmp_path / "work"
    layout = {"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}}
    blind = {m: "off" for m in ("grad_norm", "grad_norm_parts", "update_norm", "update_norm_parts")}

    now = dt.datetime.now(dt.timezone.utc)
    # tonight, and a week on (its name is its stamp: the selftest is not asked if it is due)
    week1, week2 = (f"{(now + dt.timedelta(days=d)):%Y%m%dT%H%M%SZ}-{d}" for d in (0, 7))

    def selftest(test: dict[str, Any], night: str, *due: str) -> subprocess.CompletedProcess[str]:
        path = builtin_pair(folder, file="mine.toml", steps=3, seed=3, train_config="debug",
                            control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
                            tests=[test])  # fmt: skip
        return subprocess.run(
            [sys.executable, "-m", "convergence.cli", "selftest", str(path), "--bugs",
             "gradient-2x", "--workdir", str(work), "--record-power", str(power),
             "--night", night, *due],
            cwd=folder, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip

    first = selftest(layout, week1, "--every-days", "7")
    assert first.returncode == 0, first.stdout + first.stderr
    again = selftest(layout, week1, "--every-days", "7")  # the same week: not due, not run
    assert again.returncode == 0 and "not due" in again.stdout, again.stdout + again.stderr
    second = selftest({**layout, "compare": blind}, week2)
    assert second.returncode == 1, second.stdout + second.stderr  # a bug missed
    rows = {(r["night"], r["bug"]): r["status"] for r in read_power(power)}
    assert rows == {
        (week1, "(correct)"): "passes",
        (week1, "gradient-2x"): "caught",
        (week2, "(correct)"): "passes",
        (week2, "gradient-2x"): "MISSED",
    }
    history = tmp_path / "history.jsonl"
    _pair_history(history, (week1, week2))
    out = tmp_path / "trend"
    assert main(["decide", str(history), "--out", str(out)]) == EXIT_CLEAN  # without --power
    status = main(["decide", str(history), "--out", str(out), "--power", str(power)])
    assert status == EXIT_DRIFT
    decision = json.loads((out / "decision.json").read_text())
    (finding,) = decision["findings"]
    assert finding["kind"] == "drift" and finding["metric"] == "selftest power"
    assert "gradient-2x caught at step 1 before, MISSED now" in finding["text"]


def test_the_nightly_script_runs_the_selftest_and_decides_on_its_power(tmp_path: Path) -> None:
    settings = NightlySettings(
        experiments=("experiments",),
        out=str(tmp_path / "n"),
        selftest=("experiments/quickstart.toml",),
        pytest_args=("--convergence-workdir", "/shared/conv"),
    )
    script = render_sbatch(settings)
    assert 'selftest "$exp" --launcher slurm --workdir /shared/conv' in script
    assert '--record-power "$POWER"' in script and "--every-days 7" in script
    assert 'decide "$HISTORY" --out "$OUT/trend" --power "$POWER"' in script
    path = tmp_path / "nightly.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    plain = render_sbatch(NightlySettings(experiments=("experiments",), out=str(tmp_path / "n")))
    assert "--record-power" not in plain and "--power" not in plain
    assert main(["nightly", "--experiments", "experiments", "--out", str(tmp_path / "m"),
                 "--selftest", "experiments/quickstart.toml", "--selftest-every-days", "14",
                 "--stdout"]) == 0  # fmt: skip

"""The trend that decides (convergence/nightly/decide.py): robust bands over simulated
histories, the false-alarm rate, an injected drift and a pair turned red, the exit status, the
summary files and the notification hooks (a command, an HTTP POST to a server on loopback,
$GITHUB_STEP_SUMMARY)."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from convergence.cli import main
from convergence.nightly.decide import (
    DECIDED,
    EXIT_CLEAN,
    EXIT_DRIFT,
    EXIT_RED,
    BandSettings,
    Notify,
    decide,
    write_decision,
)
from convergence.nightly.history import History

SIGMA = {
    "control_final_loss": 0.01,
    "max_abs_loss_delta": 2e-4,
    "step_time_s": 0.003,
    "control_step_time_s": 0.003,
    "tokens_per_s": 300.0,
    "control_tokens_per_s": 300.0,
    "peak_mem_mib": 5.0,
}
MEAN = {
    "control_final_loss": 2.5,
    "max_abs_loss_delta": 1e-3,
    "step_time_s": 0.1,
    "control_step_time_s": 0.1,
    "tokens_per_s": 10000.0,
    "control_tokens_per_s": 10000.0,
    "peak_mem_mib": 1000.0,
}


def _record(
    night: int, pair: str, values: dict[str, float], status: str = "passed"
) -> dict[str, Any]:
    """One history line as `convergence record` writes it (the fields decide reads)."""
    return {
        "night": f"n{night:04d}",
        "pair": pair,
        "status": status,
        "control_final_loss": values["control_final_loss"],
        "max_abs_loss_delta": values["max_abs_loss_delta"],
        "final_loss_delta": 0.0,
        "step_time_s": {"test": values["step_time_s"], "control": values["control_step_time_s"]},
        "tokens_per_s": {"test": values["tokens_per_s"], "control": values["control_tokens_per_s"]},
        "peak_mem_mib": {"test": values["peak_mem_mib"]},
    }


def _noise(rng: random.Random) -> dict[str, float]:
    return {m: MEAN[m] + rng.gauss(0.0, SIGMA[m]) for m in MEAN}


def _history(nights: int, pairs: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_record(n, f"exp::p{p}", _noise(rng)) for n in range(nights) for p in range(pairs)]


def test_false_alarm_rate_on_simulated_histories_is_small() -> None:
    # i.i.d. normal nights: every flag is a false alarm. 10 pairs x 150 nights, each night
    # decided against the nights before it (as the nightly script does), defaults (window 20,
    # k 6). Measured: 0 of 9100 pair-metric-nights; window 10 / k 5 gave 0.27%, about one
    # false alarm every 3 nights for 20 pairs x 7 metrics.
    records = _history(150, pairs=10, seed=1)
    flagged = decided = 0
    for night in range(20, 150):
        decision = decide(History(records=tuple(records[: (night + 1) * 10])))
        assert decision.night == f"n{night:04d}" and decision.pairs == 10
        decided += 10 * len(DECIDED)
        flagged += len(decision.findings)
    rate = flagged / decided
    print(f"false alarms: {flagged}/{decided} = {rate:.3%}")
    assert rate < 0.01


def test_an_injected_drift_is_flagged_with_its_own_exit_status(tmp_path: Path) -> None:
    records = _history(15)
    clean = decide(History(records=tuple(records)))
    assert clean.exit_status == EXIT_CLEAN, clean.findings
    shifted = _noise(random.Random(5))
    shifted["control_final_loss"] = MEAN["control_final_loss"] + 10 * SIGMA["control_final_loss"]
    tonight = [_record(15, "exp::p0", shifted), _record(15, "exp::p1", _noise(random.Random(6)))]
    decision = decide(History(records=tuple(records + tonight)))
    assert decision.exit_status == EXIT_DRIFT
    drift = [f for f in decision.findings if f.metric == "control_final_loss"]
    assert [f.pair for f in drift] == ["exp::p0"]
    assert "outside" in drift[0].text and drift[0].nights == 15


def test_a_pair_that_turned_red_wins_over_drift() -> None:
    records = _history(8)
    tonight = [
        _record(8, "exp::p0", _noise(random.Random(2)), status="failed"),
        _record(8, "exp::p1", _noise(random.Random(3))),
    ]
    decision = decide(History(records=tuple(records + tonight)))
    assert decision.exit_status == EXIT_RED
    assert decision.findings[0].kind == "red" and "turned failed" in decision.findings[0].text


def test_too_few_green_nights_decide_nothing() -> None:
    decision = decide(History(records=tuple(_history(3))), BandSettings(min_nights=5))
    assert decision.exit_status == EXIT_CLEAN and decision.undecided


class _Catch(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        _Catch.bodies.append(self.rfile.read(length))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_hooks_fire_on_drift_command_post_and_step_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _history(12)
    shifted = _noise(random.Random(9))
    shifted["step_time_s"] *= 1.5  # a 50% slower test step
    history = tmp_path / "history.jsonl"
    history.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in records
            + [_record(12, "exp::p0", shifted), _record(12, "exp::p1", _noise(random.Random(1)))]
        )
    )
    server = HTTPServer(("127.0.0.1", 0), _Catch)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    summary = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    got = tmp_path / "hook.txt"
    try:
        status = main(
            [
                "decide",
                str(history),
                "--out",
                str(tmp_path / "trend"),
                "--hook",
                f"cat > {got}; echo $CONVERGENCE_DECISION >> {got}",
                "--post",
                f"http://127.0.0.1:{server.server_port}/hook",
            ]
        )
    finally:
        server.shutdown()
        server.server_close()
    assert status == EXIT_DRIFT
    doc = json.loads((tmp_path / "trend" / "decision.json").read_text())
    assert doc["exit_status"] == EXIT_DRIFT and doc["findings"][0]["metric"] == "step_time_s"
    assert "DRIFT" in (tmp_path / "trend" / "decision.md").read_text()
    assert "exp::p0: step time s (test)" in got.read_text()
    assert str(tmp_path / "trend" / "decision.json") in got.read_text()
    assert json.loads(_Catch.bodies[-1])["findings"][0]["pair"] == "exp::p0"
    assert "DRIFT" in summary.read_text()


def test_a_broken_hook_never_hides_the_status(tmp_path: Path) -> None:
    decision = decide(
        History(
            records=tuple(
                _history(8) + [_record(8, "exp::p0", _noise(random.Random(2)), status="error")]
            )
        )
    )
    problems = write_decision(
        decision, tmp_path, Notify(command="exit 3", url="http://127.0.0.1:9/none")
    )
    assert decision.exit_status == EXIT_RED
    assert len(problems) == 2 and "exited 3" in problems[0]

"""torchtitan's own MoE with expert parallelism, for real on CPU (gloo), in one pytest session
(pytester) with torchtitan's own step lines in CI's log:

- ``fsdp2-ep2``: the shipped pair (experiments/torchtitan/moe.toml: the DeepSeek-V3 debug
  model, FSDP2 vs FSDP2 + EP2 on the same 2 ranks, ``ep`` passed as torchtitan's
  ``parallelism.expert_parallel_degree``) passes with the default verdict, its routed experts'
  float64 grad norms those of the control at step 1;
- ``fsdp2-ep2-experts-2x``: the same layout with the experts' gradients reduced over the EP
  group once more (tests/fixtures/hooks/planted_titan_moe_bugs.py): fails on the per-part
  grad norm at step 1, the experts' parts exactly ep = 2 times the control's, the router's not.

The control is shared by both pairs (run cache): 3 jobs of 2 ranks, 1 step each (the shipped
file's: past step 1 a legitimate routing flip can part the layouts, experiments/torchtitan/moe.toml).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest
from torchtitan_session import run_experiments

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

SHIPPED = Path(__file__).resolve().parents[1] / "experiments" / "torchtitan" / "moe.toml"
EXPERTS = "moe.routed_experts.inner_experts"


def _experiment() -> dict[str, object]:
    """The shipped file as is, with the bug beside its test (and no tier: this session runs
    it at the default one)."""
    doc = tomllib.loads(SHIPPED.read_text())
    doc["experiment"].pop("tier", None)
    (correct,) = doc["test"]
    bug = {
        **correct,
        "name": "fsdp2-ep2-experts-2x",
        "hook": "planted_titan_moe_bugs:experts_reduced_over_ep_again",
        "probe": "off",  # the failure's localisation: two more jobs, not what is tested here
    }
    doc["test"] = [correct, bug]
    return doc


def _first_step(work: Path, job: str) -> dict[str, float]:
    """Step 1 of a job's step log (runs/<file>_<pair>/<side>-<name>-<key>/: the one control
    is under the first pair's folder)."""
    (log,) = (
        path
        for path in (work / "runs").glob("*/*/dump/convergence_steps.jsonl")
        if re.fullmatch(rf"{re.escape(job)}-[0-9a-f]+", path.parents[1].name)
    )
    return json.loads(log.read_text().splitlines()[0])


def test_torchtitan_ep_pair_passes_and_a_planted_ep_bug_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    result, lines, work = run_experiments(
        pytester, monkeypatch, request, {"moe.toml": _experiment()}, timeout=1800
    )
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    assert len(lines) >= 3, lines  # torchtitan's own lines: the step of each of 3 jobs
    outcomes = {
        o["pair"]["test"]["name"]: o
        for o in (json.loads(p.read_text()) for p in work.glob("sessions/*/*.outcome.json"))
    }
    assert outcomes["fsdp2-ep2"]["status"] == "passed", out
    assert outcomes["fsdp2-ep2-experts-2x"]["status"] == "failed", out
    failing = {
        v["metric"]: v
        for v in outcomes["fsdp2-ep2-experts-2x"]["verdicts"]
        if v["gate"] and not v["passed"]
    }
    assert failing["grad_norm_parts"]["first_divergent_step"] == 1, failing
    control = _first_step(work, "control-fsdp2")
    correct = _first_step(work, "test-fsdp2-ep2")
    buggy = _first_step(work, "test-fsdp2-ep2-experts-2x")
    for weight in ("w1_EFD", "w2_EDF", "w3_EFD"):
        part = f"grad_norm/{EXPERTS}.{weight}"
        # EP2 right: the experts' step-1 gradient is the control's (fp32 rounding apart).
        assert correct[part] == pytest.approx(control[part], rel=1e-4)
        assert buggy[part] / control[part] == pytest.approx(2.0, rel=1e-4)
    gate = "grad_norm/moe.router.gate"
    assert buggy[gate] == pytest.approx(control[gate], rel=1e-4)

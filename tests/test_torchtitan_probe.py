"""The numerics probe on torchtitan pairs (convergence/backends/torchtitan/probe.py), for real on
CPU (gloo), in one pytest session (pytester) with torchtitan's own step lines in CI's log:

- ``tp2``: the plain pair a user writes, one rank vs TP2, no ``compare`` table, 10 steps
  (what the probe needs is step 1; control health, on from 20 steps, has its own torchtitan
  test in tests/test_torchtitan_train.py), ``probe = "always"``: passes, and the probe at step
  1 finds every module output and gradient equal within the fp32 probe tolerance;
- ``tp2-bug``: the same TP2 layout with a planted bug in torchtitan's own TP plan, applied by a
  torchtitan hook (tests/fixtures/hooks/planted_titan_tp_bugs.py: layer 1's attention output
  projection keeps its Partial sum, relabelled Replicate): fails, and the failure names
  ``layers.1.attention.wo`` as the first differing module.

The control (one rank, 10 steps) and its probe are shared by both pairs (run cache).
"""

from __future__ import annotations

import json
import os

import pytest
from torchtitan_session import run_experiments

from experiments import experiment_doc

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

BUGGY_MODULE = "layers.1.attention.wo"

EXPERIMENT = experiment_doc(
    experiment={"description": "torchtitan: the numerics probe names the first differing module"},
    defaults={
        "backend": "torchtitan",
        "train_config": "tt_probe.toml",
        "backend_options": {"module": "llama3", "config": "llama3_debugmodel"},
        "steps": 10,
        "seed": 42,
        "local_batch_size": 2,
        "overrides": {
            "training.seq_len": 64,
            "lr_scheduler.warmup_steps": 2,
            "validator.enable": False,
        },
    },
    control={"name": "single", "parallelism": {"dp_shard": 1}},
    tests=[
        {"name": "tp2", "parallelism": {"dp_shard": 1, "tp": 2}, "probe": "always"},
        {
            "name": "tp2-bug",
            "parallelism": {"dp_shard": 1, "tp": 2},
            "hook": "planted_titan_tp_bugs:wo_partial_as_replicate",
        },
    ],
)


def test_probe_names_the_first_differing_module_of_a_torchtitan_tp_bug(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    result, lines, work = run_experiments(
        pytester, monkeypatch, request, {"tt_probe.toml": EXPERIMENT}, timeout=1800
    )
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    assert f"first differing module {BUGGY_MODULE}" in out, out  # the failure's localisation
    outcomes = {
        o["pair"]["test"]["name"]: o
        for o in (json.loads(p.read_text()) for p in work.glob("sessions/*/*.outcome.json"))
    }
    correct, buggy = outcomes["tp2"], outcomes["tp2-bug"]
    assert correct["status"] == "passed" and buggy["status"] == "failed"
    # The correct TP layout: every module output and gradient agrees at step 1.
    agree = correct["localisation"]
    assert "error" not in agree, agree
    assert agree["module"] is None and agree["parameter"] is None, agree
    assert agree["modules_compared"] > 50 and not agree.get("unmatched"), agree
    # The bug: the modules before it agree, the buggy projection is the first to differ.
    found = buggy["localisation"]
    assert found["module"] == BUGGY_MODULE and found["step"] == 1, found
    names = [row["name"] for row in found["modules"]]
    assert names.index(BUGGY_MODULE) > names.index("layers.0.attention.wo")
    assert sum(1 for line in lines if line.startswith("control-single")) >= 10

"""A clipping bug on torchtitan fails within 2 steps with the default rules (issue 47): its
``clip_grad_norm_`` called without ``pp_mesh`` (each PP stage clips with its own stage's norm;
detection_bugs/clipping.py), FSDP2 against FSDP2+PP2 (1F1B), fp32, 3 steps on CPU.

The launcher's float64 gradient norm is taken before clipping from every stage and stays right
(the loss and grad norms pass); the witness is the per-part update norm the launcher measures
around torchtitan's optimizer step (backends/torchtitan/step_log.py). The correct FSDP2+PP2
against the same control, on the same rules, is experiments/torchtitan/cpu.toml (CI).
Slow: two torchtitan jobs of 2 and 4 ranks (~3 min on 2 loaded cores); the built-in trainer's
test of the same property is tests/test_detection_clipping.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from experiments import write_toml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "detection"))

from pairs import put_bugs_on_path  # noqa: E402

from convergence.preflight import load_checked  # noqa: E402
from convergence.run.runner import Runner, RunSettings  # noqa: E402

if not os.environ.get("CI"):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.rounding]


def test_a_pp_stage_clipping_with_its_local_norm_fails_within_2_steps(tmp_path: Path) -> None:
    put_bugs_on_path()
    path = write_toml(
        tmp_path / "tt_clip.toml",
        {
            "defaults": {
                "backend": "torchtitan",
                "train_config": "tt_clip.toml",
                "backend_options": {"module": "llama3", "config": "llama3_debugmodel"},
                "steps": 3,
                "seed": 42,
                "local_batch_size": 2,
                "probe": "off",
                # Clipping acts on both sides: the debug model's grad norm is ~1.06 at max_norm
                # 1.0; a stage's own norm (~0.23) is below it, so the buggy stages do not clip.
                "overrides": {
                    "training.seq_len": 64,
                    "lr_scheduler.warmup_steps": 2,
                    "validator.enable": False,
                },
            },
            "control": {"name": "fsdp2", "parallelism": {"dp_shard": 2}},
            "test": [
                {
                    "name": "fsdp2-pp2-local-clip",
                    "parallelism": {"dp_shard": 2, "pp": 2, "pp_schedule": "1F1B"},
                    "hook": "detection_bugs.clipping:torchtitan_pp_stage_clips_with_local_norm",
                    "early_stop": False,
                }
            ],
        },
    )
    (pair,) = load_checked(path, rootdir=tmp_path).pairs
    runner = Runner(RunSettings(work_dir=tmp_path / "work", idle_limit_s=600, wall_limit_s=1800))
    outcome = runner.run_pair(pair)
    messages = [v.message for v in outcome.verdicts]
    assert outcome.status == "failed", (outcome.status, outcome.error, messages)
    update = outcome.verdict("update_norm_parts")
    assert update is not None and update.gate and not update.passed, messages
    assert update.first_divergent_step is not None and update.first_divergent_step <= 2
    grad = outcome.verdict("grad_norm")
    assert grad is not None and grad.passed, grad.message  # measured before clipping: right

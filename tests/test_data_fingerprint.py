"""Every step's data is fingerprinted and compared exactly, before any numerics.

Real trainer runs (one process, a few steps): the same data gives the same fingerprints in every
run; a side that reads other samples fails first on the data verdict, named as a data difference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from convergence.metrics.curve import Curve
from convergence.metrics.jsonl import read_jsonl
from convergence.rank.sample_hash import FINGERPRINT_BITS, sample_hash
from convergence.regimes import default_rules
from convergence.spec.pair import ComparisonRule
from convergence.stats.fingerprint import compare_fingerprints
from convergence.stats.registry import compare_all

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("data_fingerprint")

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"


def test_sample_hash_is_order_independent_and_sees_a_duplicate() -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 256, (8, 16), generator=gen)
    targets = torch.randint(0, 256, (8, 16), generator=gen)
    whole = sample_hash(inputs, targets)
    split = sample_hash(inputs[:3], targets[:3]) + sample_hash(inputs[3:], targets[3:])
    assert whole == split % 2**FINGERPRINT_BITS
    perm = torch.randperm(8, generator=gen)
    assert sample_hash(inputs[perm], targets[perm]) == whole
    duplicated = torch.cat([inputs[:1], inputs[:-1]]), torch.cat([targets[:1], targets[:-1]])
    assert sample_hash(*duplicated) != whole
    relabeled = targets.clone()
    relabeled[0, -1] = -100  # same tokens, one label ignored
    assert sample_hash(inputs, relabeled) != whole
    assert 0 <= whole < 2**FINGERPRINT_BITS


def test_comparison_names_the_first_step() -> None:
    rule = ComparisonRule(metric="data_fingerprint", method="exact")
    steps = np.arange(1, 6, dtype=np.int64)
    control = Curve("data_fingerprint", steps, np.array([11.0, 12, 13, 14, 15]))
    test = Curve("data_fingerprint", steps, np.array([11.0, 12, 99, 14, 98]))
    verdict = compare_fingerprints(rule, [control], test)
    assert not verdict.passed and verdict.first_divergent_step == 3
    assert "data differs at step 3 (test read different samples" in verdict.message
    assert compare_fingerprints(rule, [control], control).passed


def run(dump: Path, *overrides: str) -> dict[str, Curve]:
    cmd = [
        sys.executable,
        "-m",
        "convergence.trainer",
        "--config",
        str(DEBUG),
        f"--metrics.dump_folder={dump}",
        "--training.steps=3",
        "--metrics.val_every=0",
        "--metrics.enable_tensorboard=false",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(dump / "metrics.jsonl")


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Curve]:
    return run(tmp_path_factory.mktemp("control"))


def test_same_data_gives_same_fingerprints(control: dict[str, Curve], tmp_path: Path) -> None:
    # A different batch split (accumulation) reads the same samples per optimizer step.
    again = run(tmp_path, "--training.local_batch_size=4", "--training.grad_accum_steps=2")
    verdicts = {v.metric: v for v in compare_all(default_rules("paired"), [control], again)}
    data = verdicts["data_fingerprint"]
    assert data.passed and data.steps_compared == 3, data.message


def test_other_samples_fail_as_data_first(control: dict[str, Curve], tmp_path: Path) -> None:
    # The test's labels differ (some ignored): it read other data than the control.
    other = run(tmp_path, "--data.pad_fraction=0.25")
    verdicts = {v.metric: v for v in compare_all(default_rules("paired"), [control], other)}
    data = verdicts["data_fingerprint"]
    assert data.gate and not data.passed
    assert data.first_divergent_step == 1
    assert data.message.startswith("data differs at step 1 (test read different samples")

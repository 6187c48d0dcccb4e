"""The loss is the mean over every valid token of the global batch, whatever the layout.

With padded samples (`data.pad_fraction`: labels = ignore_index after a random cut), DP ranks,
CP chunks and PP microbatches hold different numbers of valid tokens. A per-rank mean averaged
over ranks would then differ from the single-process loss; the trainer's global token weighting
(train.py, TokenWeight) must not. Real gloo ranks (started warm: tests/trainer_jobs.py), a few steps of the debug model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_jobs import metrics, run_trainer_job

from convergence.trainer.config import load_train_config
from convergence.trainer.data import IGNORE_INDEX, TRAIN, BatchPlan, build_source

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("trainer_token_weighting")

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
STEPS = 3
PADDED = [
    "--data.pad_fraction=0.5",
    f"--training.steps={STEPS}",
    "--metrics.val_every=3",
    "--metrics.val_batches=1",
    "--metrics.enable_tensorboard=false",
]


def run_trainer(nproc: int, dump: Path, overrides: list[str]) -> list[dict[str, float]]:
    args = ["--config", str(DEBUG), f"--metrics.dump_folder={dump}", *PADDED, *overrides]
    run_trainer_job(0 if nproc == 1 else nproc, args, dump / "logs")
    return metrics(dump)


def test_padding_makes_ranks_hold_uneven_token_counts() -> None:
    """The precondition of the layout test: without it, it could not fail."""
    cfg = load_train_config(DEBUG, ["--data.pad_fraction=0.5"])
    source = build_source(cfg)
    plan = BatchPlan(local_batch_size=16, dp=1, dp_rank=0, grad_accum_steps=1)
    targets = source.samples(plan.indices(1, 0), TRAIN)[:, 1:]
    valid = targets != IGNORE_INDEX
    half = targets.shape[1] // 2
    assert valid[:8].sum() != valid[8:].sum()  # DP ranks of 8 samples each
    assert valid[:, :half].sum() != valid[:, half:].sum()  # CP chunks of a sequence
    assert 0 < valid.mean() < 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    return run_trainer(1, tmp_path_factory.mktemp("reference"), ["--training.local_batch_size=16"])


# Each reads 16 samples per optimizer step, as the reference does.
LAYOUTS = [
    ("cp2", 2, ["--parallelism.cp=2", "--training.local_batch_size=16"]),
    (
        "fsdp2_accum2",
        2,
        [
            "--parallelism.dp_shard=2",
            "--training.local_batch_size=4",
            "--training.grad_accum_steps=2",
        ],
    ),
    ("pp2", 2, ["--parallelism.pp=2", "--training.local_batch_size=16"]),
]


@pytest.mark.parametrize(("nproc", "overrides"), [pytest.param(n, o, id=i) for i, n, o in LAYOUTS])
def test_padded_loss_is_layout_independent(
    nproc: int, overrides: list[str], tmp_path: Path, reference: list[dict[str, float]]
) -> None:
    test = run_trainer(nproc, tmp_path, overrides)
    assert [r["step"] for r in test] == [r["step"] for r in reference] == [1, 2, 3]
    for t, r in zip(test, reference, strict=True):
        # The fp32 reduction-order noise floor, not a loose tolerance.
        assert abs(t["loss"] - r["loss"]) <= 2e-6 * r["loss"], (t["step"], t["loss"], r["loss"])
        assert abs(t["grad_norm"] - r["grad_norm"]) <= 1e-5 * r["grad_norm"], t["step"]
        # Same samples, so the same data fingerprint in every layout.
        assert t["data_fingerprint"] == r["data_fingerprint"]
    assert abs(test[-1]["val_loss"] - reference[-1]["val_loss"]) <= 2e-6 * reference[-1]["val_loss"]

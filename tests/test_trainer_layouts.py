"""Every layout of the built-in trainer reproduces the single-process run (real ranks, gloo;
started warm by the local launcher, as a pair's jobs are: tests/trainer_jobs.py).

Same seed checkpoint, same samples, fp32, deterministic: the step-1 loss and grad norm must
match the single-process reference to 1e-5 relative, and the loss over 10 steps to 1e-4
absolute. Every layout reads 16 samples per optimizer step, as the reference does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_jobs import metrics, run_trainer_job

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("trainer_layouts")

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
STEPS = 10  # a layout bug shows from step 1; 10 steps keep the drift check at half the CPU of 20
COMMON = [
    f"--training.steps={STEPS}",
    "--metrics.val_every=5",
    "--metrics.val_batches=1",
    "--metrics.enable_tensorboard=false",
]


def run_trainer(
    nproc: int, dump: Path, overrides: list[str], timeout: float = 600
) -> list[dict[str, float]]:
    """Run the trainer (``nproc`` ranks; 1: a single plain process) and return its
    metrics.jsonl records."""
    args = ["--config", str(DEBUG), f"--metrics.dump_folder={dump}", *overrides]
    run_trainer_job(0 if nproc == 1 else nproc, args, dump / "logs", timeout=timeout)
    return metrics(dump)


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("seed") / "ckpt"
    args = [
        "--config",
        str(DEBUG),
        "--checkpoint.create_seed_checkpoint=true",
        f"--checkpoint.seed_checkpoint={folder}",
    ]
    run_trainer_job(0, args, folder.parent / "logs", timeout=300)
    assert (folder / "sha256.txt").is_file()
    return folder


@pytest.fixture(scope="module")
def reference(
    seed_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, float]]:
    """The single-process run every layout is compared with: 16 samples per step."""
    dump = tmp_path_factory.mktemp("reference")
    return run_trainer(
        1,
        dump,
        [
            *COMMON,
            f"--checkpoint.seed_checkpoint={seed_checkpoint}",
            "--training.local_batch_size=16",
        ],
    )


def assert_matches(test: list[dict[str, float]], ref: list[dict[str, float]]) -> None:
    assert [r["step"] for r in test] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        rel = abs(test[0][key] - ref[0][key]) / abs(ref[0][key])
        assert rel <= 1e-5, f"step-1 {key}: {test[0][key]} vs {ref[0][key]} (rel {rel:.2e})"
    dev = max(abs(t["loss"] - r["loss"]) for t, r in zip(test, ref, strict=True))
    assert dev <= 1e-4, f"max |loss - reference| over {STEPS} steps = {dev:.2e}"
    gn_dev = max(
        abs(t["grad_norm"] - r["grad_norm"]) / r["grad_norm"]
        for t, r in zip(test, ref, strict=True)
    )
    assert gn_dev <= 1e-3, f"max relative grad-norm deviation {gn_dev:.2e}"
    val = [
        (t["val_loss"], r["val_loss"]) for t, r in zip(test, ref, strict=True) if "val_loss" in r
    ]
    assert val and all(abs(t - r) <= 1e-4 for t, r in val), val
    # Printed for the record (pytest -s): the measured agreement of this layout.
    print(f"max |dloss|={dev:.2e} max rel dgrad_norm={gn_dev:.2e}")


# (id, processes, overrides): each reads 16 samples per optimizer step.
LAYOUTS = [
    ("ddp2", 2, ["--parallelism.dp_replicate=2"]),
    ("fsdp2", 2, ["--parallelism.dp_shard=2"]),
    (
        "hsdp2x2",
        4,
        [
            "--parallelism.dp_replicate=2",
            "--parallelism.dp_shard=2",
            "--training.local_batch_size=4",
        ],
    ),
    ("fsdp2_tp2", 4, ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
    (
        "fsdp2_tp2_sp",
        4,
        ["--parallelism.dp_shard=2", "--parallelism.tp=2", "--parallelism.sequence_parallel=true"],
    ),
    (
        "fsdp2_pp2_1f1b",
        4,
        ["--parallelism.dp_shard=2", "--parallelism.pp=2", "--parallelism.pp_schedule=1F1B"],
    ),
    (
        "fsdp2_pp2_interleaved",
        4,
        [
            "--parallelism.dp_shard=2",
            "--parallelism.pp=2",
            "--parallelism.pp_schedule=Interleaved1F1B",
        ],
    ),
    ("fsdp2_cp2", 4, ["--parallelism.dp_shard=2", "--parallelism.cp=2"]),
    ("fsdp2_tp2_pp2", 8, ["--parallelism.dp_shard=2", "--parallelism.tp=2", "--parallelism.pp=2"]),
    ("grad_accum2", 1, ["--training.grad_accum_steps=2"]),
    ("fsdp2_cpu_offload", 2, ["--parallelism.dp_shard=2", "--training.cpu_offload=true"]),
    ("fsdp2_ac_full", 2, ["--parallelism.dp_shard=2", "--activation_checkpoint.mode=full"]),
    (
        "fsdp2_ac_selective_zero2",
        2,
        [
            "--parallelism.dp_shard=2",
            "--activation_checkpoint.mode=selective",
            "--parallelism.reshard_after_forward=false",
        ],
    ),
]


@pytest.mark.parametrize(("nproc", "overrides"), [pytest.param(n, o, id=i) for i, n, o in LAYOUTS])
def test_layout_matches_single_process(
    nproc: int,
    overrides: list[str],
    seed_checkpoint: Path,
    reference: list[dict[str, float]],
    tmp_path: Path,
) -> None:
    test = run_trainer(
        nproc, tmp_path, [*COMMON, *overrides, f"--checkpoint.seed_checkpoint={seed_checkpoint}"]
    )
    assert_matches(test, reference)


@pytest.mark.slow
def test_4d_fsdp_tp_pp_cp_matches(
    seed_checkpoint: Path, reference: list[dict[str, float]], tmp_path: Path
) -> None:
    test = run_trainer(
        16,
        tmp_path,
        [
            *COMMON,
            f"--checkpoint.seed_checkpoint={seed_checkpoint}",
            "--parallelism.dp_shard=2",
            "--parallelism.tp=2",
            "--parallelism.pp=2",
            "--parallelism.cp=2",
        ],
        timeout=1800,
    )
    assert_matches(test, reference)


def test_random_init_is_layout_independent(tmp_path: Path) -> None:
    """Without a seed checkpoint every layout still starts from the same weights."""
    common = ["--training.steps=1", "--metrics.enable_tensorboard=false"]
    single = run_trainer(1, tmp_path / "single", [*common, "--training.local_batch_size=16"])
    fsdp = run_trainer(2, tmp_path / "fsdp", [*common, "--parallelism.dp_shard=2"])
    assert abs(single[0]["loss"] - fsdp[0]["loss"]) <= 1e-5 * single[0]["loss"]
    assert abs(single[0]["grad_norm"] - fsdp[0]["grad_norm"]) <= 1e-5 * single[0]["grad_norm"]

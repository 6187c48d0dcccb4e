"""The forward-noise twin rounds as FSDP2+TP2 does (convergence/trainer/forward_noise.py): from
the same seed checkpoint, in bf16, its first step -- the control's layout, two ranks, every
split matmul computed in TP2's halves -- gives FSDP2+TP2's loss bit for bit and its grad norms
to float64 summation order, while the plain control differs by bf16 rounding. This is what makes
the twin's one-step gap a correct TP2's own (the anchored check, stats/anchored.py), not a
stand-in of the same size. Real ranks (started warm: tests/trainer_jobs.py), gloo; not a `rounding` test: another rounding draw
perturbs TP's partial sums where the twin has none (rank/rounding_draw.py), so the equality is
this machine's kernels against themselves, which holds on any CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_jobs import metrics, run_trainer_job

from convergence.rank.rounding_draw import ROUNDING_DRAW_ENV
from convergence.trainer.forward_noise import UNIT_ROUNDOFF

pytestmark = pytest.mark.xdist_group("tp2_twin")

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
BF16 = ["--training.param_dtype=bfloat16", "--training.steps=2", "--metrics.val_every=0"]
FSDP = ["--parallelism.dp_shard=2"]


def first_step(
    tmp: Path, name: str, nproc: int, overrides: list[str], seed: Path
) -> dict[str, float]:
    dump = tmp / name
    args = [
        "--config",
        str(DEBUG),
        f"--metrics.dump_folder={dump}",
        f"--checkpoint.seed_checkpoint={seed}",
        "--metrics.enable_tensorboard=false",
        *BF16,
        *overrides,
    ]
    # This machine's own rounding (draw 0), whatever draw the session runs under: see above.
    run_trainer_job(nproc, args, dump / "logs", env={ROUNDING_DRAW_ENV: "0"})
    return next(r for r in metrics(dump) if r.get("step") == 1)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, float]]]:
    """The seed checkpoint, and the first steps of the control and its forward-noise twin."""
    tmp = tmp_path_factory.mktemp("tp2-twin")
    seed = tmp / "seed"
    args = [
        "--config",
        str(DEBUG),
        "--checkpoint.create_seed_checkpoint=true",
        f"--checkpoint.seed_checkpoint={seed}",
    ]
    run_trainer_job(0, args, tmp / "seed-logs", timeout=300)
    u = UNIT_ROUNDOFF["bfloat16"]
    return seed, {
        "control": first_step(tmp, "control", 2, FSDP, seed),
        "twin": first_step(tmp, "twin", 2, [*FSDP, f"--training.forward_noise={u!r}"], seed),
    }


@pytest.mark.parametrize(
    ("tp", "backward_too"),
    [
        pytest.param(["--parallelism.tp=2"], True, id="tp2"),
        # Sequence parallelism also sums the norms' weight gradients over the sequence shards,
        # which the twin does not split: its forward is TP2+SP's, its backward near it.
        pytest.param(
            ["--parallelism.tp=2", "--parallelism.sequence_parallel=true"], False, id="tp2-sp"
        ),
    ],
)
def test_the_twins_first_step_is_fsdp2_tp2s_bit_for_bit(
    shared: tuple[Path, dict[str, dict[str, float]]],
    tmp_path: Path,
    tp: list[str],
    backward_too: bool,
) -> None:
    seed, runs = shared
    control, twin = runs["control"], runs["twin"]
    tp2 = first_step(tmp_path, "tp2", 4, [*FSDP, *tp], seed)
    assert twin["loss"] == tp2["loss"], (twin["loss"], tp2["loss"])
    assert control["loss"] != tp2["loss"]  # the rounding the twin adds is TP2's, and real
    for metric in ("grad_norm", "grad_norm_parts"):
        assert abs(control[metric] - tp2[metric]) > 1e-6 * abs(tp2[metric]), metric
        if backward_too:
            assert abs(twin[metric] - tp2[metric]) <= 1e-12 * abs(tp2[metric]), metric


def test_a_tp4_tests_twin_rounds_in_quarters(
    shared: tuple[Path, dict[str, dict[str, float]]], tmp_path: Path
) -> None:
    """The twin of a TP4 test (Backend.forward_twin(tp=4): ``training.forward_noise_tp``) is a
    job of its own: its step is neither the control's nor the TP2 twin's (four rounded partial
    sums per split matmul, not two), and within bf16 rounding of both."""
    seed, runs = shared
    u = UNIT_ROUNDOFF["bfloat16"]
    noise = [f"--training.forward_noise={u!r}", "--training.forward_noise_tp=4"]
    twin4 = first_step(tmp_path, "twin4", 2, [*FSDP, *noise], seed)
    for other in ("control", "twin"):
        assert twin4["loss"] != runs[other]["loss"], other
        assert abs(twin4["loss"] - runs[other]["loss"]) < 8 * u * abs(runs[other]["loss"]), other

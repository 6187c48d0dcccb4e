"""TensorBoard reader: real event files written by torch's SummaryWriter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from convergence.metrics.tensorboard import find_loss_logging_dir, read_tensorboard

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("metrics_tensorboard")

LOSS = "loss_metrics/global_avg_loss"
NUM_LONG = 10_050  # more than EventAccumulator's 10,000-point reservoir


def exact_value(step: int) -> float:
    """A float64 that float32 cannot hold: 1/3 plus a per-step offset far below float32 eps."""
    return 1.0 / 3.0 + step * 1e-12


def write(
    folder: Path, scalars: dict[str, list[tuple[int, float]]], *, new_style: bool = True
) -> None:
    writer = SummaryWriter(log_dir=str(folder))
    for tag, pairs in scalars.items():
        for step, value in pairs:
            if new_style:
                writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
            else:
                writer.add_scalar(tag, value, step)
    writer.close()


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("long") / "tb"
    write(root, {LOSS: [(s, exact_value(s)) for s in range(1, NUM_LONG + 1)]})
    return root


def test_every_point_at_float64(long_run: Path) -> None:
    loss = read_tensorboard(long_run)["loss"]
    assert loss.steps.tolist() == list(range(1, NUM_LONG + 1))  # no downsampling
    expected = np.array([exact_value(s) for s in range(1, NUM_LONG + 1)])
    assert loss.values.tobytes() == expected.tobytes()
    assert float(np.float32(expected[0])) != expected[0]  # float32 could not have held it


def test_simple_value_reads_as_float32(tmp_path: Path) -> None:
    write(
        tmp_path, {LOSS: [(1, exact_value(1)), (2, 2.5)], "grad_norm": [(1, 0.1)]}, new_style=False
    )
    metrics = read_tensorboard(tmp_path)
    assert metrics["loss"].values.tolist() == [float(np.float32(exact_value(1))), 2.5]
    assert metrics["grad_norm"].values.tolist() == [float(np.float32(0.1))]


def test_tag_names_aliases_and_units(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            LOSS: [(1, 3.0)],
            "grad_norm": [(1, 1.5)],
            "lr": [(1, 1e-4)],
            "validation/loss": [(1, 3.5)],
            "throughput(tps)": [(1, 1000.0)],
            "memory/max_reserved(GiB)": [(1, 1.5)],
            "unrelated": [(1, 0.0)],
        },
    )
    metrics = read_tensorboard(tmp_path)
    assert sorted(metrics) == [
        "grad_norm",
        "loss",
        "lr",
        "peak_mem_mib",
        "tokens_per_s",
        "val_loss",
    ]
    assert metrics["peak_mem_mib"].values.tolist() == [1536.0]  # GiB -> MiB
    assert metrics["val_loss"].values.tolist() == [3.5]


def test_torchtitan_learning_rate_tag(tmp_path: Path) -> None:
    """torchtitan 0.3.0 logs lr_schedulers.get_metrics(): lr/<optimizer class>."""
    write(tmp_path, {LOSS: [(1, 3.0), (2, 2.9)], "lr/AdamW": [(1, 8e-4), (2, 7e-4)]})
    assert read_tensorboard(tmp_path)["lr"].values.tolist() == [8e-4, 7e-4]


def test_tag_map_override(tmp_path: Path) -> None:
    write(tmp_path, {"train/loss": [(1, 0.5)], LOSS: [(1, 9.0)], "grad_norm": [(1, 2.0)]})
    metrics = read_tensorboard(tmp_path, tag_map={"train/loss": "loss"})
    assert metrics["loss"].values.tolist() == [0.5]
    assert metrics["grad_norm"].values.tolist() == [2.0]


def test_pipeline_rank_folders_pick_the_last_stage(tmp_path: Path) -> None:
    run = tmp_path / "tb" / "20250101-1200"
    for rank in range(4):
        last_stage = rank >= 2  # torchtitan: other stages log a -1.0 placeholder loss
        write(
            run / f"rank_{rank}",
            {
                LOSS: [(s, (2.0 / s if last_stage else -1.0)) for s in (1, 2, 3)],
                "grad_norm": [(s, 10.0 + rank) for s in (1, 2, 3)],
            },
        )
    assert find_loss_logging_dir(tmp_path) == run / "rank_2"
    metrics = read_tensorboard(tmp_path / "tb")
    assert metrics["loss"].values.tolist() == [2.0, 1.0, 2.0 / 3]
    assert metrics["grad_norm"].values.tolist() == [12.0, 12.0, 12.0]  # from the same rank


def test_resumed_run_merges_folders_last_value_wins(tmp_path: Path) -> None:
    write(tmp_path / "20250101-1200", {LOSS: [(1, 3.0), (2, 2.0), (3, 9.9)]})
    write(tmp_path / "20250101-1300", {LOSS: [(3, 1.5), (4, 1.0)]})
    loss = read_tensorboard(tmp_path)["loss"]
    assert loss.steps.tolist() == [1, 2, 3, 4]
    assert loss.values.tolist() == [3.0, 2.0, 1.5, 1.0]


def test_truncated_last_record_is_ignored(tmp_path: Path) -> None:
    write(tmp_path, {LOSS: [(1, 3.0), (2, 2.0)]})
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    data = event_file.read_bytes()
    event_file.write_bytes(data[:-6])  # the last record cut short, as if mid-write
    assert read_tensorboard(event_file)["loss"].values.tolist() == [3.0]


def test_corrupt_file_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {LOSS: [(1, 3.0)]})
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    data = bytearray(event_file.read_bytes())
    data[0] ^= 0xFF  # first record's length no longer matches its checksum
    event_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        read_tensorboard(tmp_path)


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_tensorboard(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="enable_tensorboard"):
        read_tensorboard(tmp_path)
    assert find_loss_logging_dir(tmp_path) is None
    write(tmp_path / "other", {"grad_norm": [(1, 1.0)]})
    assert find_loss_logging_dir(tmp_path) is None


def test_torchtitan_cpu_memory_sentinel_is_no_measurement(tmp_path: Path) -> None:
    """Issue 52: torchtitan 0.3 on CPU logs max_reserved as -1 byte in GiB (its
    DeviceMemoryMonitor's default when memory_stats() is empty), which read as -9.5e-07 MiB and
    was compared. Such a run has no peak-memory curve, and the default (non-gating) rule
    compares nothing and says "not compared"."""
    from convergence.spec.rules import PERFORMANCE_RULES
    from convergence.stats.registry import compare_all

    gib = 1024**3
    for side in ("control", "test"):
        write(
            tmp_path / side,
            {
                LOSS: [(1, 3.0), (2, 2.9)],
                "memory/max_reserved(GiB)": [(1, -1 / gib), (2, -1 / gib)],
            },
        )
    control, test = read_tensorboard(tmp_path / "control"), read_tensorboard(tmp_path / "test")
    assert "peak_mem_mib" not in control and "peak_mem_mib" not in test
    (rule,) = [r for r in PERFORMANCE_RULES if r.metric == "peak_mem_mib"]
    (verdict,) = compare_all([rule], [control], test)
    assert verdict.steps_compared == 0 and not verdict.gate, verdict
    assert "missing in the" in verdict.message and "not compared" in verdict.message, verdict
    # A real measurement still reads, 0 included (a GPU's first step may reserve nothing).
    write(tmp_path / "gpu", {LOSS: [(1, 3.0)], "memory/max_reserved(GiB)": [(1, 0.0), (2, 2.0)]})
    assert read_tensorboard(tmp_path / "gpu")["peak_mem_mib"].values.tolist() == [0.0, 2048.0]

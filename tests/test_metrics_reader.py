"""The one metrics reader: our run folders, torchtitan/TensorBoard dumps, JSONL, golden files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convergence.metrics.golden import export_golden
from convergence.metrics.reader import (
    MetricsPathMissing,
    NoMetricsFound,
    describe_source,
    read_metrics,
    read_run,
)
from convergence.spec.errors import SpecError

#: The tags torchtitan's MetricsProcessor writes (and our trainer mirrors).
TORCHTITAN_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tokens_per_s": "throughput(tps)",
}


def write_torchtitan_dump(
    dump: Path, losses: list[float], *, grad_scale: float = 1.0, pp_ranks: int = 0
) -> Path:
    """A torchtitan-style dump: ``<dump>/tb/<timestamp>/[rank_<N>/]events.out.tfevents.*``.

    With ``pp_ranks`` every rank writes, and all but the last log torchtitan's -1.0 placeholder
    loss (only the last pipeline stage computes it).
    """
    from torch.utils.tensorboard import SummaryWriter

    run = dump / "tb" / "20250101-1200"
    folders = [run] if not pp_ranks else [run / f"rank_{r}" for r in range(pp_ranks)]
    for index, folder in enumerate(folders):
        last = index == len(folders) - 1
        with SummaryWriter(log_dir=str(folder)) as writer:
            for step, loss in enumerate(losses, start=1):
                writer.add_scalar(TORCHTITAN_TAGS["loss"], loss if last else -1.0, step)
                writer.add_scalar(
                    TORCHTITAN_TAGS["grad_norm"], grad_scale * (2.0 - 0.01 * step), step
                )
                writer.add_scalar(TORCHTITAN_TAGS["lr"], 1e-3 * min(1.0, step / 4), step)
                writer.add_scalar(TORCHTITAN_TAGS["tokens_per_s"], 1000.0, step)
    return dump


def write_jsonl_run(folder: Path, losses: list[float], *, inside_dump: bool = True) -> Path:
    target = folder / "dump" if inside_dump else folder
    target.mkdir(parents=True)
    with (target / "metrics.jsonl").open("w") as f:
        for step, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": 1.5, "lr": 1e-3}) + "\n")
    return folder


LOSSES = [4.0 - 0.05 * s for s in range(1, 11)]


def test_reads_a_torchtitan_dump_folder_with_lr(tmp_path: Path) -> None:
    dump = write_torchtitan_dump(tmp_path / "outputs", LOSSES)
    metrics = read_metrics(dump)
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= set(metrics)
    assert metrics["loss"].steps.tolist() == list(range(1, 11))
    assert metrics["loss"].values.tolist() == pytest.approx(LOSSES, rel=1e-6)  # float32 tags
    assert metrics["lr"].values[-1] == pytest.approx(1e-3)
    assert describe_source(dump) == "TensorBoard folder"


def test_pipeline_dump_reads_the_rank_holding_the_real_loss(tmp_path: Path) -> None:
    dump = write_torchtitan_dump(tmp_path / "outputs", LOSSES, pp_ranks=2)
    loss = read_metrics(dump)["loss"]
    assert -1.0 not in loss.values.tolist()
    assert loss.values.tolist() == pytest.approx(LOSSES, rel=1e-6)


def test_reads_our_run_folder_a_jsonl_file_and_a_golden(tmp_path: Path) -> None:
    run = write_jsonl_run(tmp_path / "run", LOSSES)
    from_folder = read_metrics(run)
    assert from_folder["loss"].values.tolist() == LOSSES  # exact: JSONL keeps float64
    assert describe_source(run) == "run folder (dump/metrics.jsonl)"
    from_file = read_metrics(run / "dump" / "metrics.jsonl")
    assert from_file["grad_norm"].values.tolist() == [1.5] * 10
    golden = export_golden(from_folder, tmp_path / "g.json")
    assert read_metrics(golden)["loss"].values.tolist() == LOSSES
    assert describe_source(golden) == "golden"


def test_missing_path_and_empty_folder_are_different_errors(tmp_path: Path) -> None:
    with pytest.raises(MetricsPathMissing, match="does not exist"):
        read_metrics(tmp_path / "typo")
    (tmp_path / "empty" / "logs").mkdir(parents=True)
    with pytest.raises(NoMetricsFound, match="no metrics.jsonl.*events.out.tfevents"):
        read_metrics(tmp_path / "empty")
    with pytest.raises(SpecError) as missing:
        read_run(tmp_path / "typo", key="golden")
    with pytest.raises(SpecError) as empty:
        read_run(tmp_path / "empty")
    assert "does not exist" in str(missing.value) and "key 'golden'" in str(missing.value)
    assert "no metrics found" in str(empty.value) and "does not exist" not in str(empty.value)
    assert "fix:" in str(missing.value) and "fix:" in str(empty.value)


def test_a_file_of_unknown_keys_holds_no_metrics(tmp_path: Path) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text('{"step": 1, "train_loss": 2.0}\n')
    with pytest.raises(NoMetricsFound, match="key/tag map"):
        read_metrics(path)
    assert read_metrics(path, key_map={"train_loss": "loss"})["loss"].values.tolist() == [2.0]


def test_a_broken_golden_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "golden.json"
    path.write_text("{}")
    with pytest.raises(SpecError, match="not a golden file"):
        read_run(path)

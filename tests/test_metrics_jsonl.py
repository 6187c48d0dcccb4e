"""JSONL reader and live tail: real files, written the way the trainer writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convergence.metrics.jsonl import JsonlTail, read_jsonl


def write_lines(path: Path, records: list[dict[str, object]], tail: str = "") -> None:
    with path.open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
        f.write(tail)


def test_reads_metrics_at_full_precision_and_ignores_others(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_lines(
        path,
        [
            {"event": "start", "step": 0, "loss": 99.0},
            {"step": 1, "loss": 1 / 3, "grad_norm": 2.5, "wall_s": 0.1, "lr": 1e-3},
            {"step": 2, "loss": 0.1 + 0.2, "grad_norm": 2.0, "note": "x"},
            {"step": 3, "loss": 0.25, "val_loss": 0.5, "peak_mem_mib": True},
        ],
    )
    metrics = read_jsonl(path)
    assert sorted(metrics) == ["grad_norm", "loss", "lr", "val_loss"]
    assert metrics["loss"].steps.tolist() == [1, 2, 3]
    assert metrics["loss"].values.tolist() == [1 / 3, 0.1 + 0.2, 0.25]  # exact float64
    assert metrics["val_loss"].steps.tolist() == [3]
    assert "wall_s" not in metrics and "note" not in metrics


def test_truncated_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], tail='{"step": 3, "lo')
    assert read_jsonl(path)["loss"].steps.tolist() == [1, 2]


def test_complete_last_line_without_newline_counts(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 1, "loss": 2.0}], tail='{"step": 2, "loss": 1.0}')
    assert read_jsonl(path)["loss"].steps.tolist() == [1, 2]


def test_bad_middle_line_warns_and_reads_on(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 1, "loss": 2.0}], tail='{"step": 2, "lo\n')
    write_lines(path, [{"step": 2, "loss": 1.0}])
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2"):
        assert read_jsonl(path)["loss"].values.tolist() == [2.0, 1.0]


def test_repeated_step_keeps_last_and_nan_survives(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_lines(
        path,
        [
            {"step": 1, "loss": 2.0},
            {"step": 2, "loss": 9.0},
            {"step": 2, "loss": 1.0},
            {"step": 3, "loss": float("nan")},
        ],
    )
    loss = read_jsonl(path)["loss"]
    assert loss.values[:2].tolist() == [2.0, 1.0]
    assert loss.values[2] != loss.values[2]


def test_key_map_renames_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_lines(path, [{"step": 1, "train_loss": 0.5, "loss": 7.0, "gnorm": 3.0, "lr": 0.1}])
    metrics = read_jsonl(path, key_map={"train_loss": "loss", "gnorm": "grad_norm"})
    assert metrics["loss"].values.tolist() == [0.5]  # the mapped key wins over "loss"
    assert metrics["grad_norm"].values.tolist() == [3.0]
    assert metrics["lr"].values.tolist() == [0.1]  # our own names still read


def test_key_map_to_unknown_metric_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_lines(path, [{"step": 1, "x": 1.0}])
    with pytest.raises(ValueError, match="unknown metric 'lss'"):
        read_jsonl(path, key_map={"x": "lss"})


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_tail_returns_only_new_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == []  # not written yet
    write_lines(path, [{"step": 1, "loss": 2.0}], tail='{"step": 2, ')
    assert tail.poll() == [{"step": 1, "loss": 2.0}]
    assert tail.poll() == []
    with path.open("a") as f:
        f.write('"loss": 1.5}\nnot json\n{"step": 3, "loss": 1.0}\n')
    assert tail.poll() == [{"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.0}]
    assert tail.poll() == []


def test_tail_rereads_a_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}])
    tail = JsonlTail(path)
    assert len(tail.poll()) == 2
    path.unlink()
    write_lines(path, [{"step": 1, "loss": 3.0}])
    assert tail.poll() == [{"step": 1, "loss": 3.0}]

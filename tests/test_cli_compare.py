"""``convergence compare`` / ``export-golden`` on torchtitan TensorBoard dumps and on our runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_metrics_reader import LOSSES, write_jsonl_run, write_torchtitan_dump

from convergence.cli import main
from convergence.metrics.golden import golden_metadata

REPO = Path(__file__).resolve().parents[1]


def test_two_torchtitan_dumps_gate_on_loss_and_grad_norm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_torchtitan_dump(tmp_path / "baseline", LOSSES)
    b = write_torchtitan_dump(tmp_path / "candidate", LOSSES)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "paired regime" in out
    for metric in ("loss", "grad_norm"):  # pytest's default gating metrics
        assert any(line.split()[:3] == [metric, "paired", "pass"] for line in out.splitlines())


def test_two_tb_folders_are_named_by_the_segments_that_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two dumps' tb folders: "tb vs tb" named neither run."""
    a = write_torchtitan_dump(tmp_path / "baseline", LOSSES)
    b = write_torchtitan_dump(tmp_path / "candidate", LOSSES)
    tb_a, tb_b = next(a.rglob("tb")), next(b.rglob("tb"))
    assert tb_a.relative_to(a) == tb_b.relative_to(b)
    assert main(["compare", str(tb_a), str(tb_b)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"compare candidate/{tb_b.relative_to(b).as_posix()} vs baseline/")


def test_a_scaled_gradient_fails_with_pytests_failure_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Same loss, doubled grad norm: what Adam hides in the loss and the grad norm shows.
    a = write_torchtitan_dump(tmp_path / "baseline", LOSSES)
    bug = write_torchtitan_dump(tmp_path / "bug", LOSSES, grad_scale=2.0)
    assert main(["compare", str(a), str(bug)]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("compare bug vs baseline: grad_norm diverges from step 1")
    assert "FAILED: test bug vs control baseline, paired regime" in out
    assert f"test run: {bug}" in out
    assert "grad_norm around the divergence:" in out
    assert f"control run: {a}" in out and f"test run: {bug}" in out


def test_method_and_metric_choices_match_pytests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_torchtitan_dump(tmp_path / "a", LOSSES)
    bug = write_torchtitan_dump(tmp_path / "bug", LOSSES, grad_scale=2.0)
    assert main(["compare", str(a), str(bug), "--metric", "loss", "--method", "exact"]) == 0
    assert "loss         exact" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["compare", str(a), str(bug), "--method", "eyeball"])
    capsys.readouterr()
    plain = write_jsonl_run(tmp_path / "plain", LOSSES)
    assert main(["compare", str(plain), str(a), "--metric", "tokens_per_s"]) == 2
    err = capsys.readouterr().err
    assert "plain" in err and "no 'tokens_per_s' curve" in err and "fix:" in err


def test_seed_regime_with_replicates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import math

    def losses(seed: int, shift: float = 0.0) -> list[float]:
        return [4.0 - 0.02 * s + 0.01 * math.sin(s * (seed + 1)) + shift for s in range(1, 61)]

    controls = [write_jsonl_run(tmp_path / f"seed{k}", losses(k)) for k in range(3)]
    same = write_jsonl_run(tmp_path / "same", losses(7))
    off = write_jsonl_run(tmp_path / "off", losses(7, shift=0.5))
    replicate_args = [a for c in controls[1:] for a in ("--replicate", str(c))]
    assert main(["compare", str(controls[0]), str(same), *replicate_args]) == 0
    assert "seed regime" in capsys.readouterr().out
    assert main(["compare", str(controls[0]), str(off), *replicate_args]) == 1
    assert main(["compare", str(controls[0]), str(same), "--regime", "seed"]) == 2
    assert "--replicate" in capsys.readouterr().err


def test_twin_regime_needs_the_twin_and_judges_against_its_noise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import math

    def losses(wobble: float, shift: float = 0.0) -> list[float]:
        return [4.0 - 0.02 * s + wobble * math.sin(s) + shift for s in range(1, 61)]

    control = write_jsonl_run(tmp_path / "control", losses(0.0))
    twin = write_jsonl_run(tmp_path / "twin", losses(1e-3))
    same = write_jsonl_run(tmp_path / "same", losses(-2e-3))
    off = write_jsonl_run(tmp_path / "off", losses(0.0, shift=0.05))
    twin_args = ["--regime", "twin", "--replicate", str(twin)]
    assert main(["compare", str(control), str(same), *twin_args]) == 0
    assert "twin regime" in capsys.readouterr().out
    assert main(["compare", str(control), str(off), *twin_args]) == 1
    assert main(["compare", str(control), str(same), "--regime", "twin"]) == 2
    assert "--replicate" in capsys.readouterr().err


def test_missing_path_and_folder_without_metrics_say_different_things(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write_torchtitan_dump(tmp_path / "a", LOSSES)
    assert main(["compare", str(a), str(tmp_path / "typo")]) == 2
    missing = capsys.readouterr().err
    (tmp_path / "logs_only").mkdir()
    assert main(["compare", str(a), str(tmp_path / "logs_only")]) == 2
    empty = capsys.readouterr().err
    assert "typo" in missing and "does not exist" in missing
    assert "logs_only" in empty and "no metrics found" in empty
    assert "does not exist" not in empty


def _train(dump: Path, steps: int = 3) -> None:
    """One real run of the built-in trainer (one process, no torchrun needed)."""
    cmd = [
        sys.executable,
        "-m",
        "convergence.trainer",
        "--config",
        str(REPO / "train_configs" / "debug.toml"),
        f"--metrics.dump_folder={dump}",
        f"--training.steps={steps}",
        "--metrics.val_every=0",
    ]
    done = subprocess.run(
        cmd,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_two_of_our_runs_and_a_golden_with_provenance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    _train(a / "dump")
    _train(b / "dump")
    assert main(["compare", str(a), str(b)]) == 0
    assert "PASSED" in capsys.readouterr().out

    golden = tmp_path / "golden.json"
    assert main(["export-golden", str(a), str(golden)]) == 0
    meta = golden_metadata(golden)
    import torch

    assert meta["environment"]["torch"] == torch.__version__
    assert meta["environment"]["hardware"]
    assert meta["source_kind"] == "run folder (dump/metrics.jsonl)"
    assert len(meta["config_hash"]) == 64 and meta["layout"]["dp_shard"] >= 1
    assert "git_commit" in meta
    assert main(["compare", str(golden), str(b)]) == 0
    assert "another environment" not in capsys.readouterr().out

    # The same golden as if recorded on another stack: the verdict says so.
    document = json.loads(golden.read_text())
    document["metadata"]["environment"]["torch"] = "2.5.1"
    golden.write_text(json.dumps(document))
    assert main(["compare", str(golden), str(b)]) == 0
    out = capsys.readouterr().out
    assert "recorded in another environment" in out and f"torch 2.5.1 -> {torch.__version__}" in out

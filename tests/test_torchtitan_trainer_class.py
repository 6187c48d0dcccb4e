"""The launcher's trainer is one torchtitan ``Trainer`` subclass (backends/torchtitan/
trainer_class.py) and its features compose: a real torchtitan config gets ``ConvergenceTrainer``
(an experiment's own Trainer subclass gets ours on top), and one real torchtitan job on 1 CPU
rank, launched as the backend launches it, saves the anchored check's anchors while the step
log records every step and our norms reach torchtitan's TensorBoard scalars (~1 min)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

from convergence.backends.torchtitan import TorchtitanBackend
from convergence.backends.torchtitan.anchors import MANIFEST
from convergence.backends.torchtitan.argv import TB_TAGS
from convergence.backends.torchtitan.config_parser import parse
from convergence.metrics.tensorboard import read_tensorboard
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout
from convergence.spec.run_dir import DumpDir
from convergence.spec.trainer_request import TrainerRequest

ROOT = Path(__file__).resolve().parents[1]


def test_a_parsed_torchtitan_config_builds_our_trainer_class() -> None:
    from torchtitan.trainer import Trainer

    from convergence.backends.torchtitan.trainer_class import ConvergenceTrainer, trainer_class

    config = parse(("--module", "llama3", "--config", "llama3_debugmodel"))
    assert type(config) is Trainer.Config  # what the shipped experiments parse to
    assert trainer_class(config) is ConvergenceTrainer
    assert issubclass(ConvergenceTrainer, Trainer)
    assert Trainer.Config._owner is Trainer  # ours defines no Config: torchtitan's is untouched

    class OwnTrainer(Trainer):  # an experiment's own trainer, as torchtitan's Flux has
        @dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            extra: int = 1

    composed = trainer_class(dataclasses.replace(OwnTrainer.Config(), model_spec=None))
    assert composed.__mro__[1:4] == (ConvergenceTrainer, OwnTrainer, Trainer)
    with pytest.raises(SystemExit, match="not a torchtitan Trainer"):
        trainer_class(object())


def test_anchors_are_saved_while_the_step_log_records(tmp_path: Path) -> None:
    steps = 3
    job = JobSpec(
        name="anchored-control",
        train_config=ROOT / "pyproject.toml",
        backend="torchtitan",
        layout=ParallelLayout(dp_shard=1),
        local_batch_size=2,
        steps=steps,
        seed=42,
        overrides=(
            ("training.seq_len", "64"),
            ("lr_scheduler.warmup_steps", "2"),
            ("validator.enable", "false"),
        ),
        source="exp.toml",
        backend_options=(("assets_dir", str(tmp_path / "assets")),),
        request=TrainerRequest(anchor_every=1),
    )
    dump = tmp_path / "dump"
    entry = TorchtitanBackend().train_entry(job, dump, None)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "convergence.launch.loopback_torchrun",
            "--standalone",
            "--nproc-per-node=1",
            *entry,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "convergence: ConvergenceTrainer (log, anchor_every)" in out

    # The anchors: every step but the last, each in the manifest once DCP wrote it.
    anchors = DumpDir(dump).anchors
    manifest = json.loads((anchors / MANIFEST).read_text())
    assert manifest["anchors"] == [1, 2]
    assert all((anchors / f"step-{k}" / ".metadata").is_file() for k in (1, 2))
    assert not (anchors / f"step-{steps}").exists()  # torchtitan's forced last save skipped

    # The step log: one line per step, in its order (gradients, torchtitan's norm, update).
    lines = [json.loads(x) for x in DumpDir(dump).step_log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        keys = list(line)
        assert keys[:4] == ["step", "data_fingerprint", "grad_norm", "grad_norm_parts"]
        assert keys.index("torchtitan_grad_norm") < keys.index("update_norm")
        assert abs(line["grad_norm"] / line["torchtitan_grad_norm"] - 1) < 1e-3
        assert line["update_norm"] > 0
    # Our float64 norms in torchtitan's TensorBoard folder, beside its own scalars.
    board = read_tensorboard(DumpDir(dump).tensorboard, TB_TAGS)
    assert list(board["grad_norm"].steps) == [1, 2, 3]
    for line, value in zip(lines, board["grad_norm"].values, strict=True):
        assert abs(float(value) / line["grad_norm"] - 1) < 1e-6  # stored as float32
    assert list(board["loss"].steps) == [1, 2, 3]  # torchtitan's own line, unchanged

"""The trainer as a process: bad config, graceful stop, run metadata, TensorBoard, user hooks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
QUICK = ["--training.steps=3", "--metrics.val_every=0"]


def trainer_cmd(nproc: int, dump: Path, overrides: list[str]) -> list[str]:
    module = [
        "-m",
        "convergence.trainer",
        "--config",
        str(DEBUG),
        f"--metrics.dump_folder={dump}",
        *overrides,
    ]
    if nproc == 1:
        return [sys.executable, *module]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *module,
    ]


def run(
    nproc: int, dump: Path, overrides: list[str], extra_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        trainer_cmd(nproc, dump, overrides),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def records(dump: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def meta(dump: Path) -> dict[str, object]:
    return json.loads((dump / "run_meta.json").read_text())  # type: ignore[no-any-return]


def test_bad_degree_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    proc = run(1, tmp_path, [*QUICK, "--parallelism.tp=3"])
    assert proc.returncode == 2
    assert "parallelism.tp" in proc.stderr and "n_heads" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unimportable_hook_fails_at_start(tmp_path: Path) -> None:
    proc = run(1, tmp_path, [*QUICK, "--parallelism.hook=no_such_pkg.mod:apply"])
    assert proc.returncode == 2
    assert "parallelism.hook" in proc.stderr and "no_such_pkg" in proc.stderr


def test_seed_checkpoint_hash_and_metadata(tmp_path: Path) -> None:
    ckpt = tmp_path / "seed"
    create = subprocess.run(
        [
            sys.executable,
            "-m",
            "convergence.trainer",
            "--config",
            str(DEBUG),
            "--checkpoint.create_seed_checkpoint=true",
            f"--checkpoint.seed_checkpoint={ckpt}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert create.returncode == 0, create.stderr
    sha = (ckpt / "sha256.txt").read_text().strip()
    assert len(sha) == 64 and sha in create.stdout
    dump = tmp_path / "run"
    proc = run(1, dump, [*QUICK, f"--checkpoint.seed_checkpoint={ckpt}"])
    assert proc.returncode == 0, proc.stderr
    info = meta(dump)
    assert info["seed_checkpoint_sha256"] == sha
    assert info["status"] == "finished" and info["last_step"] == 3
    assert info["world_size"] == 1 and info["tokens_per_step"] == 8 * 64
    assert 0 < float(info["entropy_floor"]) < 5.55  # below log(256): a learnable language
    rows = records(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) >= {"loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_mib", "wall_s"}


def test_tensorboard_has_torchtitan_tags_at_full_precision(tmp_path: Path) -> None:
    proc = run(1, tmp_path, ["--training.steps=2", "--metrics.val_every=2"])
    assert proc.returncode == 0, proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    tags = set(acc.Tags()["tensors"])
    assert {
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "lr",
        "throughput(tps)",
        "memory/max_reserved(MiB)",
        "validation_metrics/loss",
    } <= tags
    from tensorboard.util import tensor_util

    event = acc.Tensors("grad_norm")[0]
    value = float(tensor_util.make_ndarray(event.tensor_proto))
    assert value == records(tmp_path)[0]["grad_norm"]  # exact float64, not float32


def test_stop_file_ends_the_run_cleanly(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        trainer_cmd(1, tmp_path, ["--training.steps=100000"]),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_metrics(tmp_path, proc)
        (tmp_path / "STOP").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    info = meta(tmp_path)
    assert info["status"] == "stopped"
    assert info["last_step"] == len(records(tmp_path)) < 100000


def test_sigterm_to_torchrun_stops_every_rank_cleanly(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        trainer_cmd(2, tmp_path, ["--training.steps=100000", "--parallelism.dp_shard=2"]),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_metrics(tmp_path, proc)
        # torchrun forwards SIGTERM to its workers; they finish the step and agree to stop.
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    info = meta(tmp_path)
    assert info["status"] == "stopped"
    assert info["last_step"] == len(records(tmp_path))


def wait_for_metrics(dump: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300
    while not (dump / "metrics.jsonl").is_file() or not (dump / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "no metrics after 300 s"
        time.sleep(0.2)


HOOKS = '''
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, parallelize_module)

from convergence.rank.hooks import HookContext


class _DoubleGrad(torch.autograd.Function):
    """Identity forward, doubled gradient: the loss is unchanged, the grad norm is not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def double_grad(model: nn.Module, ctx: HookContext) -> None:
    assert ctx.mode == "after" and ctx.config.parallelism.hook.endswith(":double_grad")
    model.register_forward_hook(lambda module, args, out: _DoubleGrad.apply(out))


def mlp_tp(model: nn.Module, ctx: HookContext) -> None:
    assert ctx.mode == "replace_tp" and ctx.tp_mesh is not None
    for block in model.layers.values():
        parallelize_module(block.feed_forward, ctx.tp_mesh, {
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
'''


@pytest.fixture()
def hook_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "hookpkg"
    folder.mkdir()
    (folder / "my_hooks.py").write_text(textwrap.dedent(HOOKS))
    return folder


def test_after_hook_is_applied_on_every_rank(tmp_path: Path, hook_dir: Path) -> None:
    base = run(2, tmp_path / "base", [*QUICK, "--parallelism.dp_shard=2"])
    assert base.returncode == 0, base.stderr[-3000:]
    hooked = run(
        2,
        tmp_path / "hooked",
        [*QUICK, "--parallelism.dp_shard=2", "--parallelism.hook=my_hooks:double_grad"],
        hook_dir,
    )
    assert hooked.returncode == 0, hooked.stderr[-3000:]
    b, h = records(tmp_path / "base")[0], records(tmp_path / "hooked")[0]
    assert h["loss"] == pytest.approx(b["loss"], rel=1e-6)  # same forward
    assert h["grad_norm"] == pytest.approx(2 * b["grad_norm"], rel=1e-5)  # doubled gradient


def test_replace_tp_hook_matches_builtin_math(tmp_path: Path, hook_dir: Path) -> None:
    """A hand-written (MLP-only) TP plan in place of the built-in one: same numbers as FSDP."""
    fsdp = run(2, tmp_path / "fsdp", [*QUICK, "--parallelism.dp_shard=2"])
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    hooked = run(
        4,
        tmp_path / "tp",
        [
            *QUICK,
            "--parallelism.dp_shard=2",
            "--parallelism.tp=2",
            "--parallelism.hook=my_hooks:mlp_tp",
            "--parallelism.hook_mode=replace_tp",
        ],
        hook_dir,
    )
    assert hooked.returncode == 0, hooked.stderr[-3000:]
    for f, h in zip(records(tmp_path / "fsdp"), records(tmp_path / "tp"), strict=True):
        assert h["loss"] == pytest.approx(f["loss"], abs=1e-5)
        assert h["grad_norm"] == pytest.approx(f["grad_norm"], rel=1e-5)

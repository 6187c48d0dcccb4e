"""A warm start trains exactly what a fresh start trains (issue 39).

The jobs of a paired fp32 pair (one rank against FSDP over two) and of a bf16 twin pair with a
user hook (control and its forward-noise twin, FSDP over two ranks, the hook imported from the
job's PYTHONPATH) run once through torchrun and once forked from the fork server; every value
each job logs is compared exactly (bitwise: JSON floats round-trip), timings aside.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import LaunchRequest

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"
TIMINGS = frozenset({"wall_s", "tokens_per_s", "peak_mem_mib"})
"""Logged values that measure the run rather than result from it."""

HOOK = """
import torch
from torch import nn


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


# A monkeypatch that must not outlive this job's ranks (the fork server never runs a hook).
torch.nn.functional._convergence_hooked = True


def double_grad(model: nn.Module, ctx) -> None:
    model.register_forward_hook(lambda module, args, out: _DoubleGrad.apply(out))
"""

JOBS: dict[str, tuple[int, list[str], bool]] = {
    # name: (ranks, overrides, hooked)
    "fp32-control": (1, [], False),
    "fp32-fsdp2": (2, ["--parallelism.dp_shard=2"], False),
    "bf16-control": (2, ["--parallelism.dp_shard=2", "--training.param_dtype=bfloat16"], True),
    "bf16-twin": (
        2,
        [
            "--parallelism.dp_shard=2",
            "--training.param_dtype=bfloat16",
            "--training.forward_noise=0.001",
        ],
        True,
    ),
}


def _seed(tmp: Path) -> Path:
    seed = tmp / "seed"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "convergence.trainer",
            "--config",
            str(DEBUG),
            "--checkpoint.create_seed_checkpoint=true",
            f"--checkpoint.seed_checkpoint={seed}",
            f"--metrics.dump_folder={tmp / 'seed-creator'}",
        ],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    return seed


def _records(
    launcher: LocalLauncher, tmp: Path, name: str, seed: Path, hook_dir: Path
) -> list[dict[str, float]]:
    nproc, overrides, hooked = JOBS[name]
    dump = tmp / launcher.start / name
    entry = [
        "-m",
        "convergence.trainer",
        "--config",
        str(DEBUG),
        "--training.steps=3",
        "--metrics.val_every=0",
        f"--metrics.dump_folder={dump}",
        f"--checkpoint.seed_checkpoint={seed}",
        *overrides,
    ]
    if hooked:
        entry.append("--parallelism.hook=identity_hooks:double_grad")
    request = LaunchRequest(
        name=f"{launcher.start}-{name}",
        entry=entry,
        nproc=nproc,
        log_dir=dump / "logs",
        metrics_path=dump / "metrics.jsonl",
        stop_file=dump / "STOP",
        total_steps=3,
        env={"PYTHONPATH": str(hook_dir)} if hooked else {},
        cwd=REPO,
    )
    result = launcher.launch(request)
    assert result.status == "ok", result
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMINGS} for x in lines]


@pytest.mark.rounding
@pytest.mark.parametrize("pair", ["fp32-paired", "bf16-twin-hooked"])
def test_a_warm_start_logs_bitwise_what_torchrun_logs(tmp_path: Path, pair: str) -> None:
    hook_dir = tmp_path / "hooks"
    hook_dir.mkdir()
    (hook_dir / "identity_hooks.py").write_text(textwrap.dedent(HOOK))
    seed = _seed(tmp_path)
    names = (
        ["fp32-control", "fp32-fsdp2"] if pair == "fp32-paired" else ["bf16-control", "bf16-twin"]
    )
    warm, torchrun = LocalLauncher(start="warm"), LocalLauncher(start="torchrun")
    logged: dict[str, list[dict[str, float]]] = {}
    for name in names:
        fresh = _records(torchrun, tmp_path, name, seed, hook_dir)
        logged[name] = _records(warm, tmp_path, name, seed, hook_dir)
        assert len(fresh) == 3 and all("loss" in r for r in fresh), fresh
        assert logged[name] == fresh, name

"""This process in the torchrun world: its device, the process group, determinism, and the
two cross-rank agreements of the loop (which ranks count a step's tokens, the logged loss).

Every rank runs the same code on the same samples from the same weights; what differs between
layouts is only which ranks a sum runs over, named here.
"""

from __future__ import annotations

import faulthandler
import os
import signal

import torch
import torch.distributed as dist

from convergence.process_lifetime import die_with_parent
from convergence.rank.meshes import Meshes
from convergence.spec.errors import SpecError
from convergence.trainer.config import TrainConfig


def pick_device(cfg: TrainConfig) -> torch.device:
    kind = cfg.training.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        # Modulo: with CONVERGENCE_RANKS_PER_GPU > 1 (convergence.launch.pool) a job may have
        # more ranks on this machine than visible GPUs; they share them round-robin.
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def set_determinism(cfg: TrainConfig, device: torch.device) -> None:
    torch.manual_seed(cfg.training.seed)
    if not cfg.training.deterministic:
        return
    if device.type == "cuda":
        # cuBLAS needs a fixed workspace to be deterministic; must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def process_group_backend(device: torch.device) -> str:
    """NCCL when every local rank has its own GPU, else gloo.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). On CUDA tensors gloo runs the
    classic collectives (all-reduce, reduce-scatter, all-gather, broadcast: staged through host
    memory), which is all FSDP, DDP, HSDP and CP call; it does not run point-to-point sends (PP)
    nor DTensor's functional collectives (TP): :func:`check_shared_gpu` refuses those, and the
    placement at collection (convergence.launch.placement) runs such pairs on CPU before any
    job starts. The table, measured: README "Ranks sharing a GPU". For two ranks gloo's sums
    are the very IEEE operations NCCL does (a + b in the reduce dtype), so a one-GPU machine
    can still run 2-rank layouts."""
    if device.type != "cuda":
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if local_world <= torch.cuda.device_count() else "gloo"


def check_shared_gpu(cfg: TrainConfig) -> None:
    """Ranks sharing a GPU through gloo: refuse what gloo cannot run on CUDA tensors, with the
    fix. The placement at collection never sends such a job here; this is the guard for a job
    launched some other way (a calibration, a hand-made pool)."""
    problems = {
        # Seen on an H200 with torch 2.11: DTensor's functional all-gather over gloo on CUDA
        # tensors ends the rank with SIGSEGV.
        "tp": "tensor parallelism (DTensor's functional collectives crash there)",
        # gloo's send hands the CUDA pointer to writev: "Bad address", SIGABRT in
        # torch.distributed.pipelining's _wait_batch_p2p.
        "pp": "pipeline parallelism (gloo's point-to-point aborts on CUDA tensors)",
    }
    for axis, what in problems.items():
        if getattr(cfg.parallelism, axis) > 1:
            raise SpecError(
                f"{what} cannot run with ranks sharing a GPU through gloo",
                file=cfg.source,
                key=f"parallelism.{axis}",
                fix="give each rank its own GPU, run the pair through the plugin or "
                "`convergence run` (they place it on CPU), or set training.device = "
                '"cpu"',
            )


def init_distributed(device: torch.device) -> bool:
    """Join the torchrun world if there is one; a plain process runs without a process group."""
    # A native crash (SIGSEGV in a kernel, SIGABRT from C++) prints every thread's Python stack
    # to this rank's stderr log, which the launcher's failure message quotes.
    faulthandler.enable(all_threads=True)
    # On SIGUSR1 (the launcher, when the job hangs) write the stacks too and go on: the rank
    # that is not waiting in a collective is the one that hangs (convergence/launch/hang.py).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "WORLD_SIZE" not in os.environ:
        return False
    # The agent ends us politely (SIGTERM) when it is told to stop; if the agent itself is
    # killed outright, nobody would: die with it (convergence.process_lifetime).
    die_with_parent(signal.SIGKILL)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device))
    return True


def data_group(meshes: Meshes | None) -> dist.ProcessGroup | None:
    """The ranks holding different samples (dp), for the step's token count and fingerprint."""
    if meshes is None or meshes.data.size() == 1:
        return None
    return meshes.data.get_group()


def average_over(value: torch.Tensor, meshes: Meshes | None) -> torch.Tensor:
    """Mean of a per-rank scalar over the dp x cp ranks (gloo has no AVG: SUM / size)."""
    if meshes is None or meshes.dp_cp.size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=meshes.dp_cp.get_group())
    return value / meshes.dp_cp.size()

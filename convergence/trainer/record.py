"""The record of a run: run_meta.json (what ran, and how it ended) and one metrics line per
logged step (metrics.jsonl and TensorBoard, metrics_writer.py).

Only the rank holding the loss writes (:func:`is_logger`); every rank still calls the record's
methods, because the peak memory it logs is agreed over all ranks (a collective).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from convergence.rank.meshes import Meshes
from convergence.rank.norms import parts_geomean
from convergence.trainer import checkpoint as ckpt
from convergence.trainer.comm_count import META_KEY, count_collectives
from convergence.trainer.config import TrainConfig
from convergence.trainer.data import BatchPlan, SampleSource
from convergence.trainer.engines import Engine, MicrostepFn
from convergence.trainer.metrics_writer import MetricsWriter, RunStatus
from convergence.trainer.model import ModelArgs, build_model, count_params
from convergence.trainer.optim import StepNorms


def is_logger(engine: Engine, meshes: Meshes | None) -> bool:
    """The one writer: global rank 0, or with PP the first rank of the last stage."""
    if meshes is None:  # not distributed
        return True
    return engine.holds_loss and all(c == 0 for c in meshes.world.get_coordinate()[1:])  # type: ignore[index]


@dataclass(kw_only=True)
class RunRecord:
    """run_meta.json and the metrics of each logged step, for one run on this rank."""

    cfg: TrainConfig
    is_writer: bool
    """Whether this rank writes the files (:func:`is_logger`)."""
    distributed: bool
    device: torch.device
    plan: BatchPlan
    source: SampleSource
    model_args: ModelArgs
    parts: tuple[str, ...]
    """The model's parts, in the order of the per-part gradient norms (optim.model_parts)."""
    counter: CollectiveCounter

    def __post_init__(self) -> None:
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.tokens_per_step = self.plan.global_batch_size * self.cfg.data.seq_len
        self.writer = MetricsWriter(
            Path(self.cfg.metrics.dump_folder),
            enabled=self.is_writer,
            tensorboard=self.cfg.metrics.enable_tensorboard,
        )
        self.num_params = count_params(build_model(self.model_args, "meta"))
        self.start = time.perf_counter()

    def begin(self, last_step: int) -> None:
        """run_meta.json says "running" (from after `last_step`); wall_s counts from here."""
        self.write_meta("running", last_step)
        self.start = time.perf_counter()

    def log_step(
        self,
        step: int,
        *,
        loss: torch.Tensor | None,
        norms: StepNorms,
        lr: float,
        seconds: float,
        data_fingerprint: int,
        val_loss: float | None,
        extra: dict[str, float | int] | None = None,
    ) -> None:
        """The metrics line of `step`, every metrics.log_freq steps and at the last one.
        `loss`: the global mean loss (None off the last PP stage). Every rank calls it."""
        training = self.cfg.training
        if step % self.cfg.metrics.log_freq != 0 and step != training.steps:
            return
        peak_mem = peak_mem_over_ranks(self.device, self.distributed)  # a collective
        if not self.is_writer or loss is None:
            return
        record: dict[str, float | int] = {
            "step": step,
            "loss": loss.item(),
            "grad_norm": norms.grad.item(),
            "grad_norm_parts": parts_geomean(norms.grad_parts),
            **{
                f"grad_norm/{part}": float(norm)
                for part, norm in zip(self.parts, norms.grad_parts.tolist(), strict=True)
            },
            "update_norm": norms.update.item(),
            "update_norm_parts": parts_geomean(norms.update_parts),
            **{
                f"update_norm/{part}": float(norm)
                for part, norm in zip(self.parts, norms.update_parts.tolist(), strict=True)
            },
            "lr": lr,
            "tokens_per_s": self.tokens_per_step / seconds,
            "peak_mem_mib": peak_mem,
            "wall_s": time.perf_counter() - self.start,
            # < 2**48: exact as a JSON number / float64 (rank/sample_hash.py FINGERPRINT_BITS).
            "data_fingerprint": data_fingerprint,
        }
        if val_loss is not None:
            record["val_loss"] = val_loss
        record.update(extra or {})  # MoE: routing (moe.StepRouting.metrics)
        self.writer.log(record)

    def end(self, status: RunStatus, last_step: int) -> None:
        """run_meta.json with how the run ended, after which step; the files closed."""
        self.write_meta(status, last_step)
        self.writer.close()

    def write_meta(self, status: RunStatus, last_step: int) -> None:
        self.writer.write_meta(
            {
                **run_meta(
                    self.cfg,
                    self.world_size,
                    self.source,
                    self.num_params,
                    self.tokens_per_step,
                    self.device,
                    status,
                    last_step,
                ),
                META_KEY: self.counter.counts,
                "block_pattern": self.cfg.model.block_pattern or "standard",
            }
        )


def run_meta(
    cfg: TrainConfig,
    world_size: int,
    source: SampleSource,
    num_params: int,
    tokens_per_step: int,
    device: torch.device,
    status: RunStatus,
    last_step: int,
) -> dict[str, Any]:
    par = cfg.parallelism
    seed_ckpt = cfg.checkpoint.seed_checkpoint
    return {
        "world_size": world_size,
        "layout": {
            "dp_replicate": par.dp_replicate,
            "dp_shard": par.dp_shard,
            "tp": par.tp,
            "cp": par.cp,
            "pp": par.pp,
            "pp_schedule": par.pp_schedule,
            "pp_microbatches": par.microbatches if par.pp > 1 else 0,
            "stages_per_rank": par.stages_per_rank,
            "sequence_parallel": par.sequence_parallel,
        },
        "seed_checkpoint": seed_ckpt,
        "seed_checkpoint_sha256": ckpt.checkpoint_sha256(seed_ckpt) if seed_ckpt else None,
        "entropy_floor": source.entropy_floor,
        "num_params": num_params,
        "tokens_per_step": tokens_per_step,
        "torch_version": torch.__version__,
        "device": str(device),
        "status": status,
        "last_step": last_step,
        "config": cfg.to_dict(),
    }


def step_seconds(step_start: float, device: torch.device) -> float:
    """Seconds since `step_start` (time.perf_counter), once the GPU has run the step's work."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - step_start


def peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def peak_mem_over_ranks(device: torch.device, distributed: bool) -> float:
    """Peak memory per rank (MiB), the largest over all ranks: the rank that runs out first.

    GPU: the caching allocator's peak reserved bytes. CPU: the process's peak resident set,
    which includes the Python/torch runtime (~400 MiB) besides the tensors. Every rank must
    call this (it is a collective), not only the rank that logs.
    """
    peak = torch.tensor([peak_mem_mib(device)], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def add_counts(total: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Two collective counts (``CollectiveCount.to_dict()``) added; ``total`` None: ``more``."""
    if total is None:
        return more
    by_op = dict(total["by_op"])
    for name, num in more["by_op"].items():
        by_op[name] = by_op.get(name, 0) + num
    return {
        "forward": total["forward"] + more["forward"],
        "backward": total["backward"] + more["backward"],
        "total": total["total"] + more["total"],
        "by_op": dict(sorted(by_op.items())),
    }


class CollectiveCounter:
    """The collectives of one optimizer step (forward + backward of every microstep), for
    run_meta.json (comm_count.py)."""

    def __init__(self, cfg: TrainConfig) -> None:
        # Step 1, or step 2 under PP (a dispatch mode breaks the schedule's first-step shape
        # inference; with PP each rank sees only its own stages' collectives). Not with compile.
        self.step = None if cfg.training.compile else (2 if cfg.parallelism.pp > 1 else 1)
        self.counts: dict[str, Any] | None = None

    def around(self, step: int, run: MicrostepFn) -> MicrostepFn:
        """`run`, counted on the step that is counted."""
        if step != self.step:
            return run

        def counted(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
            # One counting scope per microstep, added up (comm_count.py).
            with count_collectives() as comm:
                loss = run(inputs, targets)
            self.counts = add_counts(self.counts, comm.to_dict())
            return loss

        return counted

"""The training loop of the reference trainer. Read it top to bottom.

    torchrun --standalone --nproc-per-node N -m convergence.trainer --config X.toml [--a.b=c ...]

Every layout (DDP, FSDP, HSDP, TP, SP, PP, CP, their products) runs this same loop on the same
samples from the same weights, so the loss and the gradient norm of step s are the same numbers
up to floating-point reduction order. That is what a convergence pair compares.
"""

from __future__ import annotations

import faulthandler
import os
import resource
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from convergence.phase_marks import mark
from convergence.process_lifetime import die_with_parent
from convergence.spec.errors import SpecError
from convergence.trainer import anchors, resume
from convergence.trainer import checkpoint as ckpt
from convergence.trainer import pipeline as pl
from convergence.trainer.comm_count import META_KEY, count_collectives
from convergence.trainer.config import TrainConfig
from convergence.trainer.context_parallel import shard_sequence
from convergence.trainer.data import (
    IGNORE_INDEX,
    TRAIN,
    VAL,
    BatchPlan,
    SampleSource,
    StepData,
    build_source,
    read_step,
)
from convergence.trainer.forward_noise import add_forward_noise
from convergence.trainer.hooks import HookFn, load_hook
from convergence.trainer.metrics_writer import MetricsWriter, RunStatus
from convergence.trainer.model import ModelArgs, Transformer, build_model, count_params
from convergence.trainer.optim import (
    build_optimizer,
    clip_grads_,
    grad_norms,
    lr_at,
    model_parts,
    parts_geomean,
)
from convergence.trainer.parallelize import Meshes, build_meshes, parallelize_chunk
from convergence.trainer.probe import run_probe
from convergence.trainer.step_clock import set_step
from convergence.trainer.validate import check_config, pp_microbatches, stages_per_rank

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Setup: process group, mesh, determinism


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


# ----------------------------------------------------------------------------------------------
# Model: build on meta, parallelise, materialise, load the seed weights


def materialize(
    chunk: nn.Module, cfg: TrainConfig, model_args: ModelArgs, device: torch.device
) -> None:
    """Allocate the (sharded) chunk, recompute buffers, load the seed weights."""
    # With CPU offload FSDP keeps the sharded parameters on the CPU.
    chunk.to_empty(device="cpu" if cfg.training.cpu_offload else device)
    for module in chunk.modules():
        if isinstance(module, Transformer):
            module.retie()
            module.init_buffers()
            module.freqs_cis = module.freqs_cis.to(device)
    if cfg.checkpoint.seed_checkpoint:
        ckpt.load_seed_checkpoint(chunk, cfg.checkpoint.seed_checkpoint)
    else:
        # Same weights as a seed checkpoint of training.seed would hold, in any layout.
        ckpt.load_full_state(chunk, ckpt.full_model(model_args, cfg.training.seed).state_dict())


def prepare_chunk(
    model: Transformer,
    cfg: TrainConfig,
    model_args: ModelArgs,
    meshes: Meshes | None,
    hook: HookFn | None,
    device: torch.device,
    *,
    stage_index: int = 0,
    num_stages: int = 1,
) -> nn.Module:
    """A meta-device chunk (the whole model, or one PP stage) -> ready to train."""
    chunk = parallelize_chunk(
        model, meshes, cfg, hook, stage_index=stage_index, num_stages=num_stages
    )
    materialize(chunk, cfg, model_args, device)
    return chunk


# ----------------------------------------------------------------------------------------------
# The loss: the mean over every valid token of the global batch, whatever the layout.
#
#   global mean loss = (1/N) * sum over the N valid tokens of the step (labels != IGNORE_INDEX),
#   N counted over all data-parallel ranks and microsteps before the step's forward (read_step).
#   Each rank, each microstep, computes the SUM of its local token losses times w = D/N, where
#   D = dp*cp is the number of ranks FSDP/DDP AVERAGE gradients over; backward() sums the
#   microsteps and the gradient reduction divides by D:
#       (1/D) * sum_ranks sum_micro (D/N) * sum_tokens loss = (1/N) * sum loss
#   -- the gradient of the global mean, also when ranks hold different numbers of valid tokens
#   (padding, CP chunks of a padded sample). A per-rank mean averaged over ranks would weight
#   the tokens of a sparsely filled rank more: not the single-device loss. The logged loss is
#   the same sum: the all-reduce over dp x cp of the local (D/N)-weighted sums, divided by D.
#   With PP the schedule divides each microbatch loss by the number of microbatches M
#   (pipeline.build_schedule), so the PP loss function multiplies by M to undo it.


@dataclass
class TokenWeight:
    """w = D/N of the step (or validation pass) running now; read by the loss function."""

    num_ranks: int
    """D: the ranks that gradients (and the logged loss) are averaged over (dp x cp)."""
    value: float = 1.0

    def use(self, num_tokens: int) -> None:
        """Weight for a global batch holding `num_tokens` valid targets."""
        # A batch without any valid target contributes nothing (0 * sum of nothing = 0).
        self.value = self.num_ranks / max(num_tokens, 1)


def make_loss_fn(weight: TokenWeight, undo_divisor: int = 1) -> LossFn:
    """Weighted sum of the token losses; `undo_divisor` cancels a division applied later."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return ce * (weight.value * undo_divisor)

    return loss_fn


@dataclass(kw_only=True)
class Engine:
    """What the loop needs from the parallel setup, whatever the layout."""

    chunks: list[nn.Module]
    """The model chunks this rank trains (one without PP)."""
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
    """Runs one microstep on the local batch; returns this rank's loss, None off the last stage."""
    evaluate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None
    """Validation loss of a local batch (no grad), None where it is not computed."""
    holds_loss: bool
    """Whether this rank computes the loss (the last PP stage)."""
    weight: TokenWeight
    """Set per global batch (TokenWeight.use) before its forward: the loss function reads it."""


def shard_for_cp(
    inputs: torch.Tensor, targets: torch.Tensor, meshes: Meshes | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if meshes is None or meshes.cp is None:
        return inputs, targets
    return shard_sequence(inputs, meshes.cp), shard_sequence(targets, meshes.cp)


def plain_engine(chunk: nn.Module, weight: TokenWeight, meshes: Meshes | None) -> Engine:
    """Engine without PP: forward, loss, backward on the whole (sharded) model."""
    loss_fn = make_loss_fn(weight)

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # CP: this rank keeps its contiguous chunk of every sequence; its rotary offset was
        # set on the model (Transformer.position_offset) when the chunk was prepared.
        inputs, targets = shard_for_cp(inputs, targets, meshes)
        return loss_fn(chunk(inputs), targets)

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = run(inputs, targets)
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return run(inputs, targets).detach()

    return Engine(
        chunks=[chunk],
        forward_backward=forward_backward,
        evaluate=evaluate,
        holds_loss=True,
        weight=weight,
    )


def pipeline_engine(
    cfg: TrainConfig,
    model_args: ModelArgs,
    meshes: Meshes,
    hook: HookFn | None,
    device: torch.device,
    weight: TokenWeight,
) -> Engine:
    """Engine with PP: this rank's stages, each prepared like a whole model, in a schedule."""

    assert meshes.pp is not None
    par = cfg.parallelism
    spr = stages_per_rank(cfg)  # checked by check_config (pp_rules) at start
    num_stages = par.pp * spr
    pieces = pl.split_model_for_pp(
        lambda args: build_model(args, "meta"),
        model_args,
        meshes.pp.get_local_rank(),
        par.pp,
        spr,
        par.pp_schedule,
    )
    stage_ids = [index for index, _ in pieces]
    chunks = [
        prepare_chunk(
            piece, cfg, model_args, meshes, hook, device, stage_index=index, num_stages=num_stages
        )
        for index, piece in pieces
    ]
    num_micro = pp_microbatches(cfg)
    schedule = pl.build_schedule(
        chunks,
        stage_ids,
        num_stages=num_stages,
        pp_group=meshes.pp,
        device=device,
        n_microbatches=num_micro,
        loss_fn=make_loss_fn(weight, undo_divisor=num_micro),
        schedule_name=par.pp_schedule,
    )
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        inputs, targets = shard_for_cp(inputs, targets, meshes)
        return pl.pipeline_forward_backward(schedule, inputs, targets, first, last)

    def evaluate(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        inputs, targets = shard_for_cp(inputs, targets, meshes)
        return pl.pipeline_eval(schedule, inputs, targets, first, last)

    return Engine(
        chunks=chunks,
        forward_backward=forward_backward,
        evaluate=evaluate,
        holds_loss=last,
        weight=weight,
    )


def build_engine(
    cfg: TrainConfig,
    model_args: ModelArgs,
    meshes: Meshes | None,
    hook: HookFn | None,
    device: torch.device,
) -> Engine:
    """The plain or the pipeline engine, whichever the layout needs."""
    weight = TokenWeight(num_ranks=meshes.dp_cp.size() if meshes is not None else 1)
    if meshes is not None and meshes.pp is not None:
        return pipeline_engine(cfg, model_args, meshes, hook, device, weight)
    chunk = prepare_chunk(build_model(model_args, "meta"), cfg, model_args, meshes, hook, device)
    return plain_engine(chunk, weight, meshes)


MicrostepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


def microsteps(
    run: MicrostepFn, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> torch.Tensor:
    """`run` (Engine.forward_backward or Engine.evaluate) on each local batch, in order; the sum
    of the losses this rank computed (zero off the last PP stage). The one microstep loop of
    training, validation and the probe: set the token weight (TokenWeight.use) first."""
    total = torch.zeros((), device=device)
    for inputs, targets in batches:
        loss = run(inputs, targets)
        if loss is not None:
            total += loss.float()
    return total


# ----------------------------------------------------------------------------------------------
# Cross-rank agreement: the logged loss and the stop flag


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


class StopSignal:
    """Set by SIGTERM or by the STOP file; agreed by all ranks so none is left in a collective."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file
        self.sigterm = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm = True

    def should_stop(self, distributed: bool, device: torch.device) -> bool:
        rank0 = not distributed or dist.get_rank() == 0
        local = self.sigterm or (rank0 and self.stop_file.exists())
        if not distributed:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


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


def is_logger(engine: Engine, meshes: Meshes | None) -> bool:
    """The one writer: global rank 0, or with PP the first rank of the last stage."""
    if meshes is None:  # not distributed
        return True
    return engine.holds_loss and all(c == 0 for c in meshes.world.get_coordinate()[1:])  # type: ignore[index]


def probe_step(cfg: TrainConfig) -> int | None:
    """The step the numerics probe replaces (convergence.trainer.probe), None without one."""
    if cfg.probe.enable and 1 <= cfg.probe.step <= cfg.training.steps:
        return cfg.probe.step
    return None


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    named_params: list[tuple[str, nn.Parameter]],
    parts: tuple[str, ...],
    pp_group: dist.ProcessGroup | None,
    max_norm: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of the accumulated gradient, clip, step, zero: (total norm, norm per part)."""
    # Norm of the full gradient (all shards, all stages) and of each part of the model
    # (optim.grad_norms: a bug in one kind of weight hides in the total), then clip.
    grad_norm, part_norms = grad_norms(named_params, parts, pp_group)
    if max_norm > 0:
        clip_grads_([p for _, p in named_params], max_norm, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, part_norms


# ----------------------------------------------------------------------------------------------
# The run


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
            "pp_microbatches": pp_microbatches(cfg) if par.pp > 1 else 0,
            "stages_per_rank": stages_per_rank(cfg),
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


def train(cfg: TrainConfig) -> RunStatus:
    """Train per `cfg` on this process's share of the world; returns the final status."""
    device = pick_device(cfg)
    distributed = init_distributed(device)
    mark("process_group")
    world_size = dist.get_world_size() if distributed else 1
    check_config(cfg, world_size)
    if distributed and device.type == "cuda" and dist.get_backend() == "gloo":
        check_shared_gpu(cfg)
    hook = load_hook(cfg.parallelism.hook, file=cfg.source) if cfg.parallelism.hook else None
    set_determinism(cfg, device)
    par, training = cfg.parallelism, cfg.training

    meshes = build_meshes(cfg, device.type) if distributed else None
    dp = par.dp_replicate * par.dp_shard
    dp_rank = meshes.data.get_local_rank() if meshes is not None else 0
    plan = BatchPlan(
        local_batch_size=training.local_batch_size,
        dp=dp,
        dp_rank=dp_rank,
        grad_accum_steps=training.grad_accum_steps,
    )
    tokens_per_step = plan.global_batch_size * cfg.data.seq_len
    source = build_source(cfg)

    model_args = ModelArgs.from_config(cfg.model, seq_len=cfg.data.seq_len)
    engine = build_engine(cfg, model_args, meshes, hook, device)
    if training.forward_noise:
        rank = dist.get_rank() if distributed else 0
        add_forward_noise(engine.chunks, training.forward_noise, seed=training.seed * 1009 + rank)
    named_params = [(n, p) for chunk in engine.chunks for n, p in chunk.named_parameters()]
    parts = model_parts(build_model(model_args, "meta"))
    optimizer = build_optimizer([p for _, p in named_params], cfg)
    pp_group = meshes.pp.get_group() if meshes is not None and meshes.pp is not None else None

    logger = is_logger(engine, meshes)
    dump = Path(cfg.metrics.dump_folder)
    writer = MetricsWriter(dump, enabled=logger, tensorboard=cfg.metrics.enable_tensorboard)
    num_params = count_params(build_model(model_args, "meta"))
    counter = CollectiveCounter(cfg)

    def meta(status: RunStatus, last_step: int) -> dict[str, Any]:
        return {
            **run_meta(
                cfg, world_size, source, num_params, tokens_per_step, device, status, last_step
            ),
            META_KEY: counter.counts,
            "block_pattern": cfg.model.block_pattern or "standard",
        }

    # A resume (checkpoint.resume_from) continues a run that stopped after step K, possibly
    # under another layout: weights and AdamW moments are loaded as this layout's shards, and
    # the loop goes on from K+1 at the saved data position and schedule position. Those two
    # are kept as offsets from the step count -- zero in a correct resume -- so a checkpoint
    # that put them elsewhere is followed, not silently corrected (resume.py).
    first_step, lr_offset, train_plan = 1, 0, plan
    if cfg.checkpoint.resume_from:
        restored = resume.load_training_checkpoint(
            cfg.checkpoint.resume_from,
            chunks=engine.chunks,
            named_params=named_params,
            optimizer=optimizer,
            cfg=cfg,
            global_batch_size=plan.global_batch_size,
            device=device,
        )
        first_step = restored.step + 1
        lr_offset = restored.lr_step - restored.step
        train_plan = replace(
            plan, offset=restored.data_position - restored.step * plan.global_batch_size
        )
    save_at = cfg.checkpoint.save_at_step

    writer.write_meta(meta("running", first_step - 1))
    stop = StopSignal(dump / "STOP")
    probe_at = probe_step(cfg)
    status: RunStatus = "failed"
    step = first_step - 1
    mark("steps_begin")
    start = time.perf_counter()
    try:
        status = "finished"
        last = probe_at - 1 if probe_at else training.steps
        for step in anchors.loop_steps(cfg, first_step, last):
            step_start = time.perf_counter()
            # An anchored job starts each of its steps from the control's state (anchors.py).
            anchored = anchors.load_anchor(
                cfg,
                step,
                plan,
                chunks=engine.chunks,
                named_params=named_params,
                optimizer=optimizer,
                device=device,
            )
            if anchored is not None:
                lr_offset, train_plan = anchored
            set_step(step)
            lr = lr_at(step + lr_offset, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # The step's batches, its global valid-token count (-> the loss weight) and its
            # data fingerprint; then forward/backward over the microsteps into .grad.
            data = read_step(source, train_plan, step, TRAIN, device, data_group(meshes))
            engine.weight.use(data.num_tokens)
            local_loss = microsteps(
                counter.around(step, engine.forward_backward), data.batches, device
            )
            grad_norm, part_norms = optimizer_step(
                optimizer, named_params, parts, pp_group, training.max_norm
            )

            # Every dp x cp rank holds (D/N) * its token-loss sum: their mean is the global mean.
            global_loss = average_over(local_loss, meshes) if engine.holds_loss else None
            val_loss = None
            if cfg.metrics.val_every and step % cfg.metrics.val_every == 0:
                val_loss = validate(engine, source, plan, meshes, cfg, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - step_start
            log_now = step % cfg.metrics.log_freq == 0 or step == training.steps
            peak_mem = peak_mem_over_ranks(device, distributed) if log_now else 0.0
            if logger and global_loss is not None and log_now:
                record: dict[str, float | int] = {
                    "step": step,
                    "loss": global_loss.item(),
                    "grad_norm": grad_norm.item(),
                    "grad_norm_parts": parts_geomean(part_norms),
                    **{
                        f"grad_norm/{part}": float(norm)
                        for part, norm in zip(parts, part_norms.tolist(), strict=True)
                    },
                    "lr": lr,
                    "tokens_per_s": tokens_per_step / step_time,
                    "peak_mem_mib": peak_mem,
                    "wall_s": time.perf_counter() - start,
                    # < 2**48: exact as a JSON number / float64 (data.FINGERPRINT_BITS).
                    "data_fingerprint": data.fingerprint,
                }
                if val_loss is not None:
                    record["val_loss"] = val_loss
                writer.log(record)
            if anchors.saves_anchor(cfg, step):
                anchors.save_anchor(
                    cfg,
                    step,
                    train_plan,
                    lr_offset,
                    chunks=engine.chunks,
                    named_params=named_params,
                    optimizer=optimizer,
                    device=device,
                )
            if step == save_at:
                # Stop here as an interrupted job would, leaving everything a resume needs.
                resume.save_training_checkpoint(
                    cfg.checkpoint.save_folder,
                    chunks=engine.chunks,
                    named_params=named_params,
                    optimizer=optimizer,
                    cfg=cfg,
                    global_batch_size=plan.global_batch_size,
                    device=device,
                    state=resume.TrainState(
                        step=step,
                        lr_step=step + lr_offset,
                        data_position=train_plan.offset + step * plan.global_batch_size,
                    ),
                )
                status = "checkpointed"
                break
            if stop.should_stop(distributed, device):
                status = "stopped"
                break
        if probe_at is not None and status == "finished":
            # The numerics probe replaces step K: one forward+backward, norms to probe.json,
            # then stop. Steps before it ran the loop above, so the probe sees exactly the
            # state this run had at this step (same data, LR, optimizer).
            step = probe_at
            set_step(step)

            def probe_forward_backward() -> torch.Tensor:
                # The loop's own data path (read_step + the token weight): the probe sees the
                # very batches the step would have trained on.
                data = read_step(source, plan, step, TRAIN, device, data_group(meshes))
                engine.weight.use(data.num_tokens)
                return microsteps(engine.forward_backward, data.batches, device)

            status = run_probe(
                cfg,
                engine,
                meshes,
                probe_forward_backward,
                device,
                is_writer=logger,
                warm_up=step == 1,
            )
    except BaseException:
        status = "failed"
        raise
    finally:
        mark("steps_end")
        writer.write_meta(meta(status, step))
        writer.close()
        if distributed:
            dist.destroy_process_group()
    return status


@torch.no_grad()
def validate(
    engine: Engine,
    source: SampleSource,
    plan: BatchPlan,
    meshes: Meshes | None,
    cfg: TrainConfig,
    device: torch.device,
) -> float | None:
    """Mean held-out loss over metrics.val_batches global batches (the training batch plan on
    the validation split, so every layout evaluates the same samples)."""
    if engine.evaluate is None:
        return None
    for chunk in engine.chunks:
        chunk.eval()
    # All validation batches form one pool: the weight is D / (their valid tokens in total).
    steps: list[StepData] = [
        read_step(source, plan, batch + 1, VAL, device, data_group(meshes))
        for batch in range(cfg.metrics.val_batches)
    ]
    engine.weight.use(sum(data.num_tokens for data in steps))
    total = microsteps(engine.evaluate, (b for data in steps for b in data.batches), device)
    for chunk in engine.chunks:
        chunk.train()
    if not engine.holds_loss:
        return None
    return float(average_over(total, meshes).item())


def create_seed(cfg: TrainConfig) -> str:
    """`--checkpoint.create_seed_checkpoint=true`: write the seed checkpoint, one process."""
    check_config(cfg, None)
    folder = cfg.checkpoint.seed_checkpoint
    if not folder:
        raise SpecError(
            "no folder to create the seed checkpoint in",
            file=cfg.source,
            key="checkpoint.seed_checkpoint",
            fix="set --checkpoint.seed_checkpoint=DIR",
        )
    model_args = ModelArgs.from_config(cfg.model, seq_len=cfg.data.seq_len)
    return ckpt.create_seed_checkpoint(model_args, cfg.training.seed, folder)

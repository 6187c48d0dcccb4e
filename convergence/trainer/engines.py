"""Engines: how this rank runs one microstep of the model, whatever the layout.

The loop (train.py) and the numerics probe see an :class:`Engine`: the chunks this rank
trains, a forward+backward and an evaluation of a local batch, and whether this rank computes
the loss. Two engines stand behind it: :class:`PlainEngine` (the whole, sharded model: DDP,
FSDP, HSDP, TP, CP) and :class:`PipelineEngine` (this rank's PP stages in a schedule). Both
build their chunks the same way: on the meta device, parallelised (parallelize.py), then
materialised with the seed weights, so every layout starts from the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from convergence.rank.hooks import HookFn
from convergence.rank.meshes import Meshes
from convergence.trainer import checkpoint as ckpt
from convergence.trainer import pipeline as pl
from convergence.trainer import precision
from convergence.trainer.config import TrainConfig
from convergence.trainer.context_parallel import shard_sequence
from convergence.trainer.data import VAL, BatchPlan, SampleSource, StepData, read_step
from convergence.trainer.loss import LossFn, TokenWeight, make_loss_fn
from convergence.trainer.model import ModelArgs, Transformer, build_model
from convergence.trainer.parallelize import parallelize_chunk
from convergence.trainer.world import average_over, data_group

MicrostepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
"""One microstep on a local batch (inputs, targets): this rank's loss, None off the last stage."""


class Engine(Protocol):
    """What the loop and the probe need from the parallel setup, whatever the layout."""

    @property
    def chunks(self) -> list[nn.Module]:
        """The model chunks this rank trains (one without PP)."""
        ...

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes the loss (the last PP stage)."""
        ...

    @property
    def weight(self) -> TokenWeight:
        """Set per global batch (TokenWeight.use) before its forward: the loss function reads
        it."""
        ...

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One microstep on the local batch, gradients into .grad; this rank's loss, None off
        the last stage."""
        ...

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Validation loss of a local batch (no gradient), None off the last stage."""
        ...


# ----------------------------------------------------------------------------------------------
# Chunks: build on meta, parallelise, materialise, load the seed weights


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
    # Low-precision linears first, as torchtitan's converters: FSDP must wrap the swapped
    # weights to all-gather them in float8 (precision.py).
    precision.convert(model, cfg, device)
    chunk = parallelize_chunk(
        model, meshes, cfg, hook, stage_index=stage_index, num_stages=num_stages
    )
    materialize(chunk, cfg, model_args, device)
    return chunk


# ----------------------------------------------------------------------------------------------
# The two engines


def shard_for_cp(
    inputs: torch.Tensor, targets: torch.Tensor, meshes: Meshes | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CP: this rank's contiguous chunk of every sequence (the whole batch without CP)."""
    if meshes is None or meshes.cp is None:
        return inputs, targets
    return shard_sequence(inputs, meshes.cp), shard_sequence(targets, meshes.cp)


@dataclass(kw_only=True)
class PlainEngine:
    """Without PP: forward, loss, backward on the whole (sharded) model."""

    chunk: nn.Module
    weight: TokenWeight
    meshes: Meshes | None
    loss_fn: LossFn
    holds_loss: bool = True

    @property
    def chunks(self) -> list[nn.Module]:
        return [self.chunk]

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # CP: this rank keeps its contiguous chunk of every sequence; its rotary offset was
        # set on the model (Transformer.position_offset) when the chunk was prepared.
        inputs, targets = shard_for_cp(inputs, targets, self.meshes)
        return self.loss_fn(self.chunk(inputs), targets)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self._loss(inputs, targets)
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets).detach()


@dataclass(kw_only=True)
class PipelineEngine:
    """With PP: this rank's stages, each prepared like a whole model, in a schedule."""

    chunks: list[nn.Module]
    weight: TokenWeight
    meshes: Meshes
    schedule: pl.PipelineSchedule
    holds_first_stage: bool
    holds_loss: bool
    """Whether this rank holds the last stage."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        inputs, targets = shard_for_cp(inputs, targets, self.meshes)
        return pl.pipeline_forward_backward(
            self.schedule, inputs, targets, self.holds_first_stage, self.holds_loss
        )

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        inputs, targets = shard_for_cp(inputs, targets, self.meshes)
        return pl.pipeline_eval(
            self.schedule, inputs, targets, self.holds_first_stage, self.holds_loss
        )


def pipeline_engine(
    cfg: TrainConfig,
    model_args: ModelArgs,
    meshes: Meshes,
    hook: HookFn | None,
    device: torch.device,
    weight: TokenWeight,
) -> PipelineEngine:
    """This rank's stages, prepared and put in the configured schedule."""
    assert meshes.pp is not None
    par = cfg.parallelism
    num_stages = par.pp * par.stages_per_rank  # checked by check_config (pp_rules) at start
    pieces = pl.split_model_for_pp(
        lambda args: build_model(args, "meta"),
        model_args,
        meshes.pp.get_local_rank(),
        par.pp,
        par.stages_per_rank,
        par.pp_schedule,
    )
    stage_ids = [index for index, _ in pieces]
    chunks = [
        prepare_chunk(
            piece, cfg, model_args, meshes, hook, device, stage_index=index, num_stages=num_stages
        )
        for index, piece in pieces
    ]
    schedule = pl.build_schedule(
        chunks,
        stage_ids,
        num_stages=num_stages,
        pp_group=meshes.pp,
        device=device,
        n_microbatches=par.microbatches,
        loss_fn=make_loss_fn(weight, undo_divisor=par.microbatches),
        schedule_name=par.pp_schedule,
    )
    return PipelineEngine(
        chunks=chunks,
        weight=weight,
        meshes=meshes,
        schedule=schedule,
        holds_first_stage=0 in stage_ids,
        holds_loss=num_stages - 1 in stage_ids,
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
    return PlainEngine(chunk=chunk, weight=weight, meshes=meshes, loss_fn=make_loss_fn(weight))


# ----------------------------------------------------------------------------------------------
# Microsteps: the one loop over local batches of training, validation and the probe


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


@torch.no_grad()
def validation_loss(
    engine: Engine,
    source: SampleSource,
    plan: BatchPlan,
    meshes: Meshes | None,
    cfg: TrainConfig,
    device: torch.device,
) -> float | None:
    """Mean held-out loss over metrics.val_batches global batches (the training batch plan on
    the validation split, so every layout evaluates the same samples); None off the last
    PP stage."""
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

"""The MoE side of the training loop: the balance loss's weight, and after every optimizer
step the global routing (tokens per expert per layer, the balance loss) for the metrics line
and the auxiliary-loss-free bias update. Nothing here for a dense model (build returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from convergence.rank.meshes import Meshes
from convergence.trainer.config import TrainConfig
from convergence.trainer.data import BatchPlan
from convergence.trainer.engines import Engine
from convergence.trainer.model import ModelArgs
from convergence.trainer.moe import set_aux_scale, step_routing, update_expert_bias


@dataclass(kw_only=True)
class MoEStep:
    chunks: list[nn.Module]
    layer_ids: tuple[int, ...]
    n_experts: int
    samples: int
    """Samples (sequences) per optimizer step, all ranks: the balance loss is their mean."""
    groups: tuple[ProcessGroup, ...]
    """Summed over: the data-parallel and CP ranks (different tokens), the PP stages
    (different layers). Not TP ranks, which route the same tokens."""
    bias_update_rate: float
    device: torch.device
    forwards: int
    """Training forwards of a layer per step: microsteps x PP microbatches."""
    with_balance: bool
    """Whether the balance loss is logged (not under CP: see moe.StepRouting.metrics)."""

    @classmethod
    def build(
        cls,
        cfg: TrainConfig,
        model_args: ModelArgs,
        engine: Engine,
        meshes: Meshes | None,
        plan: BatchPlan,
        device: torch.device,
    ) -> MoEStep | None:
        moe = model_args.moe
        if moe is None:
            return None
        num_ranks = meshes.dp_cp.size() if meshes is not None else 1
        set_aux_scale(engine.chunks, moe.aux_loss_coeff, num_ranks, plan.global_batch_size)
        groups = []
        if meshes is not None and meshes.dp_cp.size() > 1:
            groups.append(meshes.dp_cp.get_group())
        if meshes is not None and meshes.pp is not None:
            groups.append(meshes.pp.get_group())
        return cls(
            chunks=engine.chunks,
            layer_ids=tuple(i for i in range(model_args.n_layers) if model_args.is_moe_layer(i)),
            n_experts=moe.n_experts,
            samples=plan.global_batch_size,
            groups=tuple(groups),
            bias_update_rate=moe.bias_update_rate,
            device=device,
            forwards=cfg.training.grad_accum_steps * cfg.parallelism.microbatches,
            with_balance=cfg.parallelism.cp == 1,
        )

    def after_step(self) -> dict[str, float | int]:
        """The step's routing metrics; moves the expert bias when bias_update_rate is set.
        Every rank calls it (collectives)."""
        routing = step_routing(
            self.chunks,
            self.layer_ids,
            self.n_experts,
            self.samples,
            self.groups,
            self.device,
            self.forwards,
        )
        if self.bias_update_rate:
            update_expert_bias(self.chunks, routing, self.bias_update_rate)
        return routing.metrics(with_balance=self.with_balance)

"""Pipeline parallelism (PP) with torch.distributed.pipelining: split, stages, schedules.

The model is cut into `num_stages = pp * stages_per_rank` stages of contiguous blocks; stage 0
keeps `tok_embeddings`, the last stage keeps `norm` and `output` (torchtitan's
pipeline_llama_manual_split). Which stages a PP rank holds depends on the schedule's style
(loop or V); that and every other PP rule (stages per rank, supported combinations) lives in
`convergence.trainer.pp_rules`, which the collection-time checks use too.

API (what the trainer calls, in order):

    spr = resolve_stages_per_rank(schedule_name, cfg.parallelism.pp_stages_per_rank)
    chunks = split_model_for_pp(build_model, model_args, pp_rank, pp, spr, schedule_name)
        # -> [(stage_index, chunk_module), ...], chunk modules on the meta device, in the order
        # of stage_ids_this_rank(). model_factory(model_args) must return the FULL model on the
        # meta device (convergence.trainer.model.build_model does by default).
    for _, chunk in chunks:                      # the trainer's own steps, per chunk:
        tp(chunk); ac(chunk)
        fully_shard(each block) only if fsdp_per_block_ok(schedule_name)  # see its docstring
        fully_shard(chunk)                        # the chunk must be its own FSDP root
        chunk.to_empty(device=device); chunk.init_weights() / load the seed checkpoint
    schedule = build_schedule([c for _, c in chunks], [i for i, _ in chunks],
                              num_stages=pp * spr, pp_group=mesh["pp"], device=device,
                              n_microbatches=M, loss_fn=cross_entropy_loss,
                              schedule_name=schedule_name)
    # per microstep (tokens/targets: this DP rank's local batch, (local_batch, seq)):
    loss = pipeline_forward_backward(schedule, tokens, targets,
                                     has_first_stage=0 in stage_ids,
                                     has_last_stage=num_stages - 1 in stage_ids)
        # -> mean loss over the M microbatches (a detached scalar) on the rank holding the last
        #    stage, None elsewhere; gradients are accumulated into the chunks' parameters.
    is_last_stage_rank(pp_rank, pp, schedule_name)   # True where the loss lives (log there)
    pipeline_eval(schedule, tokens, targets, has_first_stage, has_last_stage)   # validation

Gradient scale: the schedule calls loss_fn once per microbatch and backpropagates each result,
so parameter gradients are the SUM over microbatches. build_schedule therefore divides every
microbatch loss by n_microbatches: sum_m grad(L_m / M) = grad(mean_m L_m), which is the
gradient of the mean loss over the local batch (microbatches hold equal token counts) - the same
gradient as the un-pipelined model on that batch. torch's own `scale_grads=True` is turned off
on purpose: it divides `p.grad` in place after the step, which would also shrink gradients
accumulated by earlier gradient-accumulation microsteps. The trainer divides by
grad_accum_steps itself, and FSDP/DDP average over DP as usual.

FSDP2 + PP (torch 2.13): PipelineStage detects an FSDPModule chunk and itself disables gradient
sync and resharding-after-backward for each microbatch backward, then runs FSDP's post-backward
(one reduce-scatter per step) after the last microbatch, so the chunk must be `fully_shard`ed as
its own root. Nothing else is needed for correct gradients. `reshard_after_forward=True` is
correct but re-all-gathers parameters for every microbatch (torchtitan turns it off under PP
for speed); it stays the user's ZeRO-2/3 knob here.

Loss value: the mean over microbatches on the last-stage rank; the trainer averages it over DP
(and broadcasts/sends it to whoever logs). The grad norm must include all PP ranks' parameters
(all-reduce the squared norm over the pp axis too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    get_schedule_class,
)

from convergence.trainer import pp_rules

# Re-exported: callers of this module (tests, hooks) name the schedule sets from here too.
from convergence.trainer.pp_rules import SCHEDULES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES  # noqa: F401

LossFn = Callable[[Tensor, Tensor], Tensor]

PipelineSchedule = _PipelineSchedule
"""What build_schedule returns (torch's base class of every schedule, a private name there)."""


def _schedule_class(schedule_name: str) -> type[_PipelineSchedule]:
    if schedule_name not in SCHEDULES:
        raise ValueError(
            f"unknown parallelism.pp_schedule {schedule_name!r}: use one of {', '.join(SCHEDULES)}"
        )
    cls: type[_PipelineSchedule] = get_schedule_class(schedule_name)
    return cls


def fsdp_per_block_ok(schedule_name: str) -> bool:
    """Whether each block of a chunk may be its own FSDP unit under this schedule.

    False for the zero-bubble schedules: on torch 2.13 their split backward (weight grads
    computed after the input grads) loses the gradients of parameters in nested FSDP units -
    measured on gloo, pp=2 x dp_shard=2: p.grad None (ZBVZeroBubble, InterleavedZeroBubble) or
    100% off (DualPipeV). Sharding each chunk as one FSDP unit is not enough in the trainer either
    (grad norm 8x too small at step 1; with DDP the gradients are not averaged), so
    `pp_rules.layout_problem` refuses zero-bubble schedules with any data or context parallelism
    at collection; this stays as the runtime guard for hooks that apply FSDP themselves.
    """
    return schedule_name not in ZERO_BUBBLE_SCHEDULES


def resolve_stages_per_rank(schedule_name: str, configured: int | None) -> int:
    """parallelism.pp_stages_per_rank with unset (None or 0) resolved (1 single-stage, 2 multi-stage), checked."""
    problem = pp_rules.schedule_problem(schedule_name)
    if problem is not None:
        _schedule_class(schedule_name)  # raises the ValueError naming the schedules
    spr = pp_rules.stages_per_rank(schedule_name, configured)
    problem = pp_rules.stages_problem(schedule_name, spr)
    if problem is not None:
        raise ValueError(
            f"parallelism.pp_schedule={schedule_name}: {problem.message}: {problem.fix}"
        )
    return spr


def stage_ids_this_rank(
    pp_rank: int, pp_size: int, stages_per_rank: int, schedule_name: str
) -> list[int]:
    """Stage indices held by PP rank `pp_rank`, in the order the schedule expects."""
    return pp_rules.stage_ids(pp_rank, pp_size, stages_per_rank, schedule_name)


def is_last_stage_rank(
    pp_rank: int, pp_size: int, schedule_name: str, stages_per_rank: int | None = None
) -> bool:
    """Whether this PP rank holds the last stage, i.e. computes (and should log) the loss."""
    spr = resolve_stages_per_rank(schedule_name, stages_per_rank)
    return pp_rules.holds_last_stage(pp_rank, pp_size, spr, schedule_name)


def split_model_for_pp(
    model_factory: Callable[[Any], nn.Module],
    model_args: Any,
    pp_rank: int,
    pp_size: int,
    stages_per_rank: int,
    schedule_name: str,
) -> list[tuple[int, nn.Module]]:
    """Build the full model (meta) and cut out this rank's stages: [(stage_index, chunk), ...].

    Each chunk is a deep copy of the full model with the other stages' blocks deleted from
    `layers` (keys keep their global names "i", so checkpoints load by name) and
    tok_embeddings / norm / output set to None where the stage does not own them.
    """
    spr = resolve_stages_per_rank(schedule_name, stages_per_rank)
    num_stages = pp_size * spr
    whole = model_factory(model_args)
    n_layers = len(_layers(whole))
    if n_layers % num_stages:
        raise ValueError(
            f"model.n_layers={n_layers} is not divisible by the {num_stages} pipeline "
            f"stages (parallelism.pp={pp_size} x {spr} stages per rank): change "
            "model.n_layers, parallelism.pp or parallelism.pp_stages_per_rank"
        )
    if getattr(getattr(whole, "args", None), "tie_embeddings", False) and num_stages > 1:
        raise ValueError(
            "model.tie_embeddings=true cannot be split across pipeline stages "
            "(embedding and output live on different ranks): set it to false"
        )
    per_stage = n_layers // num_stages
    chunks: list[tuple[int, nn.Module]] = []
    for stage in stage_ids_this_rank(pp_rank, pp_size, spr, schedule_name):
        chunk = whole if len(chunks) == spr - 1 else copy.deepcopy(whole)
        layers = _layers(chunk)
        keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
        for name in [n for n in layers if n not in keep]:
            del layers[name]
        # setattr, not nn.Module deletion: forward checks `is None` (the model's contract).
        if stage != 0:
            chunk.tok_embeddings = None  # type: ignore[assignment]
        if stage != num_stages - 1:
            chunk.norm = None  # type: ignore[assignment]
            chunk.output = None  # type: ignore[assignment]
        chunks.append((stage, chunk))
    return chunks


def _check_no_nested_fsdp(chunks: list[nn.Module], schedule_name: str) -> None:
    for chunk in chunks:
        nested = [name for name, m in chunk.named_modules() if name and isinstance(m, FSDPModule)]
        if nested:
            raise ValueError(
                f"parallelism.pp_schedule={schedule_name} splits the backward into input and "
                f"weight passes, which loses gradients of nested FSDP units on torch "
                f"{torch.__version__} (here: {nested[0]!r}): apply fully_shard to the whole "
                "chunk only (see pipeline.fsdp_per_block_ok), or use GPipe/1F1B/Interleaved1F1B"
            )


def _layers(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"{type(model).__name__}.layers must be an nn.ModuleDict of blocks "
            "for pipeline splitting (see convergence.trainer.model)"
        )
    return layers


def _pp_group(pp_mesh: DeviceMesh | ProcessGroup | None) -> ProcessGroup | None:
    if isinstance(pp_mesh, DeviceMesh):
        return pp_mesh.get_group()
    return pp_mesh


def build_schedule(
    chunks: list[nn.Module],
    stage_indices: list[int],
    num_stages: int,
    pp_group: DeviceMesh | ProcessGroup | None,
    device: torch.device,
    n_microbatches: int,
    loss_fn: LossFn,
    schedule_name: str,
) -> _PipelineSchedule:
    """PipelineStages for this rank's chunks and the named schedule driving them.

    `loss_fn(logits, targets)` is the per-microbatch MEAN loss; it is divided by n_microbatches
    here (see the module docstring for why).
    """
    if len(chunks) != len(stage_indices):
        raise ValueError(f"{len(chunks)} chunks but {len(stage_indices)} stage indices")
    if not fsdp_per_block_ok(schedule_name):
        _check_no_nested_fsdp(chunks, schedule_name)
    group = _pp_group(pp_group)
    stages = [
        PipelineStage(chunk, index, num_stages, device, group=group)
        for chunk, index in zip(chunks, stage_indices, strict=True)
    ]

    def scaled_loss(output: Tensor, target: Tensor) -> Tensor:
        return loss_fn(output, target) / n_microbatches

    cls: Any = _schedule_class(schedule_name)
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(
                f"parallelism.pp_schedule={schedule_name} takes one stage per rank, "
                f"got {len(stages)}"
            )
        single: _PipelineSchedule = cls(
            stages[0], n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=False
        )
        return single
    multi: _PipelineSchedule = cls(
        stages, n_microbatches=n_microbatches, loss_fn=scaled_loss, scale_grads=False
    )
    return multi


def _run(
    schedule: _PipelineSchedule,
    tokens: Tensor,
    targets: Tensor,
    has_first_stage: bool,
    has_last_stage: bool,
    train: bool,
    model_kwargs: dict[str, Any] | None,
) -> Tensor | None:
    n_micro = schedule._n_microbatches
    if has_first_stage and tokens.shape[0] % n_micro:
        raise ValueError(
            f"local batch {tokens.shape[0]} is not divisible by "
            f"parallelism.pp_microbatches={n_micro}: change training.local_batch_size "
            "or parallelism.pp_microbatches"
        )
    losses: list[Tensor] = []
    args = (tokens,) if has_first_stage else ()
    kwargs: dict[str, Any] = dict(model_kwargs or {})
    target = targets if has_last_stage else None
    if train:
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    else:
        schedule.eval(*args, target=target, losses=losses, **kwargs)
    if not has_last_stage:
        return None
    # Each entry is L_m / M, so their sum is the mean of the microbatch losses.
    return torch.stack([loss.detach() for loss in losses]).sum()


def pipeline_forward_backward(
    schedule: _PipelineSchedule,
    tokens: Tensor,
    targets: Tensor,
    has_first_stage: bool,
    has_last_stage: bool,
    model_kwargs: dict[str, Any] | None = None,
) -> Tensor | None:
    """One forward+backward over the local batch; grads accumulate into the chunks.

    Returns the mean microbatch loss (detached scalar) on the rank holding the last stage, else
    None. `model_kwargs` (e.g. {"position_offset": r*L} under CP) reach every stage's forward.
    """
    return _run(schedule, tokens, targets, has_first_stage, has_last_stage, True, model_kwargs)


def pipeline_eval(
    schedule: _PipelineSchedule,
    tokens: Tensor,
    targets: Tensor,
    has_first_stage: bool,
    has_last_stage: bool,
    model_kwargs: dict[str, Any] | None = None,
) -> Tensor | None:
    """Validation: mean microbatch loss on the last-stage rank, else None; grads untouched.

    Two torch 2.13 pitfalls handled here (both measured on gloo):
    - `schedule.eval()` still ends with the stage's FSDP post-backward, which drops the
      sharded gradients of an FSDP chunk (p.grad becomes None): gradients are saved and put
      back around the call.
    - `schedule.eval()` fails on the V schedules (ZBVZeroBubble, DualPipeV: "can't
      steal_bwd_input if this stage doesn't have backward"): for those a full training step runs
      on the validation batch instead (same loss, wasted backward; validation is rare).
    """
    train = isinstance(schedule, ScheduleZBVZeroBubble) or type(schedule).__name__ == (
        "ScheduleDualPipeV"  # by name: torch before 2.9 has no such class (pp_schedules.py)
    )
    params = [p for stage in _stages(schedule) for p in stage.submod.parameters()]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with torch.set_grad_enabled(train):
            return _run(
                schedule, tokens, targets, has_first_stage, has_last_stage, train, model_kwargs
            )
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad


def _stages(schedule: _PipelineSchedule) -> list[Any]:
    if isinstance(schedule, PipelineScheduleSingle):
        return [schedule._stage]
    assert isinstance(schedule, PipelineScheduleMulti)
    return list(schedule._stages)

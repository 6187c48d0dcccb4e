"""Bugs that start late: the CP-rope, row-wise all-reduce and data-loader bugs, and two MoE
bugs (the experts' 1/ep twice, the router's gradient not reduced), switched on at step S of
the test side (issue 41; the MoE ones for the anchored check's flip anchors, issue 49).

A bug that acts from step 1 is caught while the correct curves are still close; one that starts
at step 300 of a 500-step run meets curves that have long since drifted apart by legitimate
rounding. These stand for the real cases: a code path taken only after warm-up, a loader bug
after the first epoch, a kernel that switches with the sequence-length schedule.

The hook name carries S: ``late_onset:<bug>_from_<S>`` (e.g. ``cp_rope_without_offset_from_50``,
any S), built by the module's ``__getattr__``. Up to step S-1 the hook is exactly a correct
layout; from step S on (``convergence.trainer.step_clock.current_step()``, which the training
loop sets, so a resumed or anchored job at step K+1 gets K+1) it is the bug of the same name in
sequence_and_data.py / tensor_parallel.py.

A resume onto a broken layout late in a run needs no hook of its own: the catalogue's
``late_resume`` cases (catalogue.py) put the CP-rope and row-wise bugs on the resume layout of a
test that trains FSDP2 up to step 400, where they change nothing (no CP, no TP mesh).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

from convergence.trainer import data as trainer_data
from convergence.trainer.hooks import HookContext
from convergence.trainer.step_clock import current_step
from detection_bugs import moe as moe_bugs
from detection_bugs.tensor_parallel import parallelize_with_layer1_wo

Hook = Callable[[nn.Module, HookContext], None]


def _cp_rope_without_offset(start: int) -> Hook:
    def apply(model: nn.Module, ctx: HookContext) -> None:
        """CP rotary offset dropped (sequence_and_data.cp_rope_without_offset) from step S."""
        if ctx.config.parallelism.cp == 1:
            return
        right = model.position_offset  # r*L, set by the trainer before the hooks run

        def before_forward(module: nn.Module, args: Any) -> None:
            module.position_offset = 0 if current_step() >= start else right  # BUG from S

        model.register_forward_pre_hook(before_forward)

    return apply


def _rowwise_output_not_reduced(start: int) -> Hook:
    class RowwiseLosingItsReduce(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(
            output_layouts: Any,
            use_local_output: bool,
            mod: nn.Module,
            outputs: Any,
            device_mesh: Any,
        ) -> Any:
            if current_step() >= start:
                return outputs.to_local()  # BUG from S: the partial sums, never reduced
            return RowwiseParallel._prepare_output_fn(
                output_layouts, use_local_output, mod, outputs, device_mesh
            )

    def apply(model: nn.Module, ctx: HookContext) -> None:
        """hook_mode = "replace_tp": layer 1's wo loses its all-reduce from step S
        (tensor_parallel.rowwise_output_not_reduced)."""
        parallelize_with_layer1_wo(model, ctx, RowwiseLosingItsReduce())

    return apply


_ORIGINAL_INDICES = trainer_data.BatchPlan.indices


def _every_dp_rank_reads_rank0_shard(start: int) -> Hook:
    def indices(self: trainer_data.BatchPlan, step: int, microstep: int) -> np.ndarray:
        if current_step() >= start:  # BUG from S: every rank reads rank 0's samples
            self = dataclasses.replace(self, dp_rank=0)
        return _ORIGINAL_INDICES(self, step, microstep)

    def apply(model: nn.Module, ctx: HookContext) -> None:
        """Every DP rank reads rank 0's shard from step S (e.g. a sampler rebuilt at an epoch
        boundary without the rank; sequence_and_data.every_dp_rank_reads_rank0_shard)."""
        trainer_data.BatchPlan.indices = indices  # type: ignore[method-assign]

    return apply


def _moe_experts_averaged_over_ep_too(start: int) -> Hook:
    def apply(model: nn.Module, ctx: HookContext) -> None:
        """The experts' gradient averaged over the EP group once more from step S
        (moe.experts_averaged_over_ep_too): their grad_scale, which each forward reads, set
        before each forward by the step."""
        for layer in moe_bugs._moe_layers(model):
            if layer.ep_group is None:
                continue
            right, wrong = (
                layer.experts.grad_scale,
                layer.experts.grad_scale / layer.ep_group.size(),
            )

            def before_forward(module: nn.Module, args: Any, right=right, wrong=wrong) -> None:
                module.grad_scale = wrong if current_step() >= start else right

            layer.experts.register_forward_pre_hook(before_forward)

    return apply


def _moe_router_grad_not_reduced(start: int) -> Hook:
    def apply(model: nn.Module, ctx: HookContext) -> None:
        """Each rank steps the router rows it holds with its own tokens' gradient from step S
        (moe.router_grad_not_reduced); the shipped router before it."""
        shipped = {
            id(layer.router.gate): layer.router.gate.forward
            for layer in moe_bugs._moe_layers(model)
        }
        moe_bugs.router_grad_not_reduced(model, ctx)
        for layer in moe_bugs._moe_layers(model):
            gate = layer.router.gate
            buggy, right = gate.forward, shipped[id(gate)]
            gate.forward = lambda x, buggy=buggy, right=right: (  # type: ignore[method-assign]
                buggy(x) if current_step() >= start else right(x)
            )

    return apply


_FACTORIES: dict[str, Callable[[int], Hook]] = {
    "moe_experts_averaged_over_ep_too": _moe_experts_averaged_over_ep_too,
    "moe_router_grad_not_reduced": _moe_router_grad_not_reduced,
    "cp_rope_without_offset": _cp_rope_without_offset,
    "rowwise_output_not_reduced": _rowwise_output_not_reduced,
    "every_dp_rank_reads_rank0_shard": _every_dp_rank_reads_rank0_shard,
}


def __getattr__(name: str) -> Hook:
    """``<bug>_from_<S>``: the bug switched on at step S (load_hook's getattr lands here)."""
    bug, sep, start = name.rpartition("_from_")
    if sep and bug in _FACTORIES and start.isdigit() and int(start) >= 1:
        return _FACTORIES[bug](int(start))
    raise AttributeError(
        f"{__name__!r} has no {name!r}: write <bug>_from_<S>, <bug> one of {sorted(_FACTORIES)}"
    )

"""What the launcher adds to each model part after torchtitan's own parallelisation (TP,
activation checkpointing, compile, FSDP): the CPU reduction setting, then the user's hook with
the ``HookContext`` both trainers give it (convergence/rank/hooks.py)."""

from __future__ import annotations

import functools
from typing import Any

from convergence.backends.torchtitan.patches import force_sum_reduction
from convergence.rank.hooks import HookContext, apply_hook, load_hook
from convergence.rank.rounding_draw import apply_rounding_draw, rounding_draw


def hook_context(
    parallel_dims: Any, config: Any, *, mode: str, stage_index: int = 0, num_stages: int = 1
) -> HookContext:
    """The hook's HookContext, filled from torchtitan's ParallelDims (mesh axis
    names are torchtitan's: "pp", "dp_replicate", "fsdp", "cp", "tp", ...)."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_optional_mesh(names) if parallel_dims.dp_enabled else None
    pp_mesh = parallel_dims.get_optional_mesh("pp")
    return HookContext(
        mesh=parallel_dims.world_mesh,
        tp_mesh=parallel_dims.get_optional_mesh("tp"),
        dp_mesh=dp_mesh,
        config=config,
        mode=mode,
        pp_rank=pp_mesh.get_local_rank() if pp_mesh is not None else 0,
        pp_size=parallel_dims.pp,
        stage_index=stage_index,
        num_stages=num_stages,
    )


def wrap_model_spec(config: Any, *, cpu: bool, hook: str, hook_mode: str) -> None:
    """Wrap the model spec's parallelize/pipelining functions: after torchtitan's own
    parallelisation of a part, the CPU reduction setting, then the user's hook."""
    spec = config.model_spec
    hook_fn = None
    if hook:
        hook_fn = load_hook(hook)
    parallelize, pipelining = spec.parallelize_fn, spec.pipelining_fn

    @functools.wraps(parallelize)
    def parallelize_fn(model: Any, **kwargs: Any) -> Any:
        model = parallelize(model, **kwargs)
        if cpu:
            force_sum_reduction(model)
        apply_rounding_draw([model], rounding_draw())  # another machine's rounding, if asked
        parallel_dims = kwargs["parallel_dims"]
        if hook_fn is not None and not parallel_dims.pp_enabled:
            ctx = hook_context(parallel_dims, config, mode=hook_mode)
            model = apply_hook(hook_fn, model, ctx)
        return model

    spec.parallelize_fn = parallelize_fn
    if pipelining is None or hook_fn is None:
        return

    @functools.wraps(pipelining)
    def pipelining_fn(model: Any, **kwargs: Any) -> Any:
        kwargs["parallelize_fn"] = parallelize_fn
        schedule, parts, has_first, has_last = pipelining(model, **kwargs)
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for i, stage in enumerate(stages):
            ctx = hook_context(
                kwargs["parallel_dims"],
                config,
                mode=hook_mode,
                stage_index=stage.stage_index,
                num_stages=stage.num_stages,
            )
            parts[i] = apply_hook(hook_fn, parts[i], ctx)
            stage.submod = parts[i]
        return schedule, parts, has_first, has_last

    spec.pipelining_fn = pipelining_fn

"""torchtitan's own ``torchtitan.train`` behind a thin wrapper: the entry point of every
torchtitan job (``torchrun ... -m convergence.backends.torchtitan_launch [ours] [theirs]``).

torchtitan is not forked: the wrapper changes a few of its module attributes before its
``main()`` runs, then lets it parse the rest of the command line and train as usual.

Everywhere (GPU and CPU):

- ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step
  (``distributed/utils.py: set_pg_timeouts``), does not exist in torch 2.13: it is given the
  function torch does have, ``distributed_c10d._set_pg_timeout`` (same arguments).
- torchtitan 0.3.0 hands its pipeline schedule microbatch lists
  (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``) that torch 2.13's schedules do not
  take (they would split the lists again as model inputs): ``step`` gains that form
  (``patch_pipeline_step``).
- the user's hook (``--convergence.hook``) is applied to each model part after torchtitan's
  parallelisation (TP, activation checkpointing, compile, FSDP), with the built-in trainer's
  ``HookContext`` (convergence/trainer/hooks.py), and the per-step data fingerprint and
  per-part gradient norms are logged (``--convergence.log``, one JSON line per step from rank
  0, from the batches and gradients torchtitan itself uses).

On CPU only (when this rank sees no CUDA device, or with ``--convergence.cpu``;
*for tests on CPU: numerics on GPU are torchtitan's own*):

- torchtitan picks device "cuda" when no accelerator is available (``tools/utils.py``): it
  gets "cpu" (gloo) instead, with a device module that answers its memory-monitor calls;
- flex attention has no CPU backward: its compiled kernel is replaced by the same masked
  attention computed eagerly (the BlockMask's ``mask_mod`` materialised, then SDPA), and the
  block mask is built without ``torch.compile`` (inductor's C++ build costs ~80 s per job);
- FSDP's reduce-scatter with divide factor 1 uses PREMUL_SUM, which gloo lacks: FSDP is asked
  for a plain sum (``set_force_sum_reduction_for_comms``; the same math with factor 1);
- ``barrier(device_ids=[...])`` in ``set_pg_timeouts`` is a NCCL-only argument: a plain
  barrier there.

The other device-independent obstacle is handled on the command line by the backend:
torchtitan's default ``parallelism.spmd_backend = "spmd_types"`` leaves plain tensors that
torch 2.13's ``fully_shard`` refuses; the backend passes ``partial_dtensor`` (DTensor on the
model-parallel axes, FSDP2 as usual).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.trainer.data import FINGERPRINT_BITS, sample_hash
from convergence.trainer.hooks import HookContext, apply_hook, load_hook

PREFIX = "--convergence."


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The wrapper's own options (``--convergence.KEY=VALUE``; removed before torchtitan
    parses the command line)."""

    cpu: bool | None = None
    """Apply the CPU workarounds (gloo, eager attention, sum reduction); None: exactly when
    no CUDA device is available to this rank."""
    hook: str = ""
    """``package.module:function`` applied to each model part after parallelisation."""
    hook_mode: str = "after"
    """Only "after" exists for torchtitan jobs (the backend's preflight refuses others)."""
    log: str = ""
    """JSON-lines file (rank 0) for the data fingerprint and per-part gradient norms."""


def split_argv(argv: list[str]) -> tuple[LaunchOptions, list[str]]:
    """(our options, torchtitan's argv)."""
    ours: dict[str, Any] = {}
    rest: list[str] = []
    for word in argv:
        if not word.startswith(PREFIX):
            rest.append(word)
            continue
        key, sep, value = word[len(PREFIX) :].partition("=")
        if key == "cpu":
            ours["cpu"] = True
        elif key in ("hook", "hook_mode", "log") and sep:
            ours[key] = value
        else:
            raise SystemExit(
                f"torchtitan_launch: unknown option {word!r} (use "
                f"{PREFIX}cpu, {PREFIX}hook=M:F, {PREFIX}hook_mode=after, "
                f"{PREFIX}log=PATH)"
            )
    return LaunchOptions(**ours), rest


# -- CPU: the device ---------------------------------------------------------------------------


def cpu_device_module() -> Any:
    """``torch.cpu`` plus the CUDA-module calls torchtitan makes (device name, properties,
    memory statistics) answered for host memory."""
    import types

    import torch

    module = types.ModuleType("convergence_cpu_device")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.__dict__.update(
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(
            name="cpu", total_memory=total
        ),
        current_device=lambda: 0,
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
    )
    return module


def pick_cpu_device() -> None:
    """Make torchtitan's import-time device choice "cpu" (it falls back to "cuda")."""
    import torch._utils

    original = torch._utils._get_available_device_type, torch._utils._get_device_module
    module = cpu_device_module()
    setattr(torch._utils, "_get_available_device_type", lambda: "cpu")  # noqa: B010
    setattr(torch._utils, "_get_device_module", lambda device_type=None: module)  # noqa: B010
    try:
        import torchtitan.tools.utils  # noqa: F401 - evaluates device_type now
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = original


# -- timeouts ----------------------------------------------------------------------------------


def patch_timeouts(*, cpu: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torchtitan.distributed.utils as dist_utils

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = c10d._set_pg_timeout  # type: ignore[attr-defined]
    if not cpu:
        return

    def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
        dist.barrier()  # gloo takes no device_ids
        groups = [
            mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
        ]
        for group in [*groups, None]:
            c10d._set_pg_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


# -- pipelining: torchtitan 0.3.0 passes microbatch lists --------------------------------------


def patch_pipeline_step() -> None:
    """torchtitan 0.3.0 calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``
    with its microbatches already split; torch 2.13's schedules take whole-batch inputs only
    (the lists would be split again as model keyword arguments). Where ``step`` has no
    ``arg_mbs``, it gains that form: the same per-step preparation as torch's own ``step``,
    then ``_step_microbatches`` on the given lists."""
    import inspect

    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step
        if "arg_mbs" in inspect.signature(original).parameters:
            continue
        setattr(cls, "step", _microbatch_step(original))  # noqa: B010


def _microbatch_step(original: Callable[..., Any]) -> Callable[..., Any]:
    # Not functools.wraps: its __wrapped__ would make inspect.signature report the original
    # signature, and patch_pipeline_step could no longer tell a patched step.
    def step(
        self: Any,
        *args: Any,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return original(
                self,
                *args,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    step.__doc__, step.__qualname__ = original.__doc__, original.__qualname__
    return step


# -- CPU: attention ----------------------------------------------------------------------------


def eager_flex_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_aux: Any,
    kernel_options: dict[str, Any],
) -> tuple[Any, Any]:
    """``FlexAttention.compiled_flex_attn`` without a compiled kernel: the block mask's
    ``mask_mod`` evaluated on every (query, key) position, then SDPA with that boolean mask --
    exactly the attention flex computes when there is no ``score_mod`` (the debug model's
    causal / document masks)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or getattr(return_aux, "lse", False):
        raise NotImplementedError(
            "torchtitan_launch on CPU: flex attention with a score_mod "
            "or log-sum-exp output has no eager replacement"
        )
    mask = None
    if block_mask is not None:
        mask = create_mask(
            block_mask.mask_mod, q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], device=q.device
        )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, None


def patch_attention() -> None:
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention.FlexAttention.compiled_flex_attn = staticmethod(eager_flex_attention)
    # The block mask built eagerly: compiling it costs ~80 s of C++ builds on a CPU.
    attention._compiled_create_block_mask = create_block_mask


# -- the model parts: hook and CPU reductions ---------------------------------------------------


def force_sum_reduction(model: Any) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def hook_context(
    parallel_dims: Any, config: Any, *, mode: str, stage_index: int = 0, num_stages: int = 1
) -> HookContext:
    """The built-in trainer's HookContext, filled from torchtitan's ParallelDims (mesh axis
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


def wrap_model_spec(config: Any, options: LaunchOptions) -> None:
    """Wrap the model spec's parallelize/pipelining functions: after torchtitan's own
    parallelisation of a part, the CPU reduction setting, then the user's hook."""
    spec = config.model_spec
    hook_fn = None
    if options.hook:
        hook_fn = load_hook(options.hook)
    parallelize, pipelining = spec.parallelize_fn, spec.pipelining_fn

    @functools.wraps(parallelize)
    def parallelize_fn(model: Any, **kwargs: Any) -> Any:
        model = parallelize(model, **kwargs)
        if options.cpu:
            force_sum_reduction(model)
        parallel_dims = kwargs["parallel_dims"]
        if hook_fn is not None and not parallel_dims.pp_enabled:
            ctx = hook_context(parallel_dims, config, mode=options.hook_mode)
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
                mode=options.hook_mode,
                stage_index=stage.stage_index,
                num_stages=stage.num_stages,
            )
            parts[i] = apply_hook(hook_fn, parts[i], ctx)
            stage.submod = parts[i]
        return schedule, parts, has_first, has_last

    spec.pipelining_fn = pipelining_fn


# -- per-step records: the data fingerprint and per-part gradient norms -------------------------


class StepLog:
    """Collects what a step read and its gradients; rank 0 appends one JSON line per step with
    the built-in trainer's names and definitions (``data_fingerprint``: the sum of
    ``convergence.trainer.data.sample_hash`` over every sample of the global batch, mod 2**48;
    ``grad_norm_parts``: the geometric mean of the per-part gradient norms)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.digest = 0
        self.step = 0

    def on_batch(self, input_dict: dict[str, Any], labels: Any) -> None:
        self.digest += sample_hash(input_dict["input"], labels)

    def on_grads(self, parameters: list[Any], parallel_dims: Any) -> None:
        import torch
        import torch.distributed as dist

        self.step += 1
        digest = torch.tensor([self.digest % 2**FINGERPRINT_BITS], dtype=torch.int64)
        self.digest = 0
        # Summed over the ranks that read different samples only (TP/PP ranks hold copies).
        mesh = parallel_dims.get_optional_mesh("batch") if parallel_dims.dp_enabled else None
        if mesh is not None:
            dist.all_reduce(digest, group=mesh.get_group())
        parts = part_grad_norms(parameters, parallel_dims.get_optional_mesh("pp"))
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        norms = [v for v in parts.values() if v > 0]
        geomean = math.exp(sum(math.log(v) for v in norms) / len(norms)) if norms else 0.0
        record = {
            "step": self.step,
            "data_fingerprint": int(digest.item()) % 2**FINGERPRINT_BITS,
            "grad_norm_parts": geomean,
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def part_of(name: str) -> str:
    """The kind of weight a parameter is (queries, keys, MLP, norms, embeddings ...): its name
    without layer indices and wrapper prefixes."""
    words = [w for w in name.split(".") if not w.isdigit() and not w.startswith("_")]
    return ".".join(words[-2:]) if len(words) >= 2 else ".".join(words)


def part_grad_norms(parameters: list[Any], pp_mesh: Any) -> dict[str, float]:
    """Per part, the gradient's global 2-norm: DTensor shards reduced over their mesh (FSDP,
    TP), then the pipeline stages' sums of squares added (each stage holds other layers)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    squares: dict[str, float] = {}
    for name, param in parameters:
        grad = param.grad
        if grad is None:
            continue
        sq = grad.detach().double().pow(2).sum()
        if isinstance(sq, DTensor):
            sq = sq.full_tensor()
        key = part_of(name)
        squares[key] = squares.get(key, 0.0) + float(sq)
    if pp_mesh is not None:
        gathered: list[dict[str, float] | None] = [None] * pp_mesh.size()
        dist.all_gather_object(gathered, squares, group=pp_mesh.get_group())
        squares = {}
        for stage in gathered:
            for key, value in (stage or {}).items():
                squares[key] = squares.get(key, 0.0) + value
    return {k: math.sqrt(v) for k, v in sorted(squares.items())}


def patch_step_log(options: LaunchOptions) -> None:
    """Record each step's batches (Trainer.batch_generator) and gradients (just before
    torchtitan clips them)."""
    if not options.log:
        return
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.trainer import Trainer

    log = StepLog(options.log)
    generator = Trainer.batch_generator

    def batch_generator(self: Any, data_iterable: Any) -> Iterator[Any]:
        for input_dict, labels in generator(self, data_iterable):
            log.on_batch(input_dict, labels)
            yield input_dict, labels

    Trainer.batch_generator = batch_generator
    clip = dist_utils.clip_grad_norm_
    trainer_init = Trainer.__init__
    named: list[Any] = []
    state: dict[str, Any] = {}

    def init(self: Any, config: Any) -> None:
        trainer_init(self, config)
        named.extend((n, p) for m in self.model_parts for n, p in m.named_parameters())
        state["parallel_dims"] = self.parallel_dims

    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        log.on_grads(named, state["parallel_dims"])
        return clip(parameters, *args, **kwargs)

    Trainer.__init__ = init
    dist_utils.clip_grad_norm_ = clip_grad_norm_


# -- main ---------------------------------------------------------------------------------------


def install(options: LaunchOptions) -> None:
    """Every change to torchtitan's modules, before its main() runs."""
    cpu = bool(options.cpu)
    if cpu:
        pick_cpu_device()
    patch_timeouts(cpu=cpu)
    patch_pipeline_step()
    if cpu:
        patch_attention()
    patch_step_log(options)
    from torchtitan.config import ConfigManager

    parse_args = ConfigManager.parse_args

    def parse(self: Any, args: list[str] | None = None) -> Any:
        config = parse_args(self, args)
        if getattr(config, "model_spec", None) is not None:
            wrap_model_spec(config, options)
        return config

    ConfigManager.parse_args = parse


def main(argv: list[str] | None = None, entry: Callable[[], None] | None = None) -> None:
    options, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    if options.cpu is None:
        import torch

        options = dataclasses.replace(options, cpu=not torch.cuda.is_available())
    sys.argv = [sys.argv[0], *rest]  # torchtitan's parser reads sys.argv
    install(options)
    if entry is None:
        from torchtitan.train import main as titan_main

        entry = titan_main
    entry()


if __name__ == "__main__":
    main()

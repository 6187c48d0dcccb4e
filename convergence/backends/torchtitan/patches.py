"""Every change the launcher makes to torchtitan's and torch's modules, each with the versions
it is written for (``@pinned``; ``PATCHES`` lists them): the launcher and the backend's
preflight refuse other releases with a message naming each patch and its releases. torchtitan is not forked: these
module attributes are changed before its ``main()`` runs.

Everywhere (GPU and CPU):

- ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step
  (``distributed/utils.py: set_pg_timeouts``), does not exist in torch 2.13: it is given the
  function torch does have, ``distributed_c10d._set_pg_timeout`` (same arguments).
- torchtitan 0.3.0 hands its pipeline schedule microbatch lists
  (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``) that torch 2.13's schedules do not
  take (they would split the lists again as model inputs): ``step`` gains that form
  (``patch_pipeline_step``).
- the trainer's batches and gradients are observed for the per-step records
  (``record_steps``), and each parsed config's model spec is wrapped (``on_parsed_config``)
  for the user's hook (convergence/backends/torchtitan/model_parts.py).

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

The other device-independent obstacle is handled on the command line by the backend
(convergence/backends/torchtitan/argv.py): torchtitan's default
``parallelism.spmd_backend = "spmd_types"`` leaves plain tensors that torch 2.13's
``fully_shard`` refuses; the backend passes ``partial_dtensor`` (DTensor on the model-parallel
axes, FSDP2 as usual).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar


class StepLog(Protocol):
    """What record_steps feeds (step_log.StepLog). A Protocol, not an import: step_log needs
    the trainer's torch modules, and this module is read at collection (unsupported_releases)."""

    def on_batch(self, input_dict: Any, labels: Any) -> None: ...
    def on_grads(self, named: Any, parallel_dims: Any, *, step: int) -> None: ...
    def on_clipped(self, torchtitan_norm: float, named: Any) -> None: ...
    def on_stepped(self, named: Any) -> None: ...
    def tensorboard_extras(self) -> dict[str, float]: ...

    record: dict[str, float | int]


PatchFn = TypeVar("PatchFn", bound=Callable[..., Any])


@dataclass(frozen=True)
class Pin:
    """The releases a patch is written for: version prefixes ("0.3" is any 0.3.x)."""

    torchtitan: str
    torch: str


#: Every patch in this module -> the releases it is written for.
PATCHES: dict[str, Pin] = {}


def pinned(*, torchtitan: str, torch: str) -> Callable[[PatchFn], PatchFn]:
    """Register a patch with the torchtitan and torch releases it reaches into."""

    def register(fn: PatchFn) -> PatchFn:
        PATCHES[fn.__name__] = Pin(torchtitan=torchtitan, torch=torch)
        return fn

    return register


def release(version: str) -> tuple[int, ...]:
    """The leading numeric components of a version ("2.13.0+cpu" -> (2, 13, 0))."""
    parts = []
    for word in version.split("+")[0].split("."):
        digits = re.match(r"\d+", word)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != word:  # "0rc1": the rest is a pre-release tag
            break
    return tuple(parts)


def installed_releases() -> dict[str, str]:
    """The installed torchtitan and torch versions (from their metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torchtitan", "torch"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:  # a source checkout without metadata: not checked
            continue
    return found


def unsupported_releases(installed: dict[str, str] | None = None) -> str | None:
    """Why the installed torchtitan/torch are not what the patches are written for (naming
    each patch and its releases), or None when every patch's releases match."""
    installed = installed_releases() if installed is None else installed
    wrong = []
    for patch, pin in PATCHES.items():
        for name, wanted in (("torchtitan", pin.torchtitan), ("torch", pin.torch)):
            have = installed.get(name)
            want = release(wanted)
            if have is not None and release(have)[: len(want)] != want:
                wrong.append(f"{patch} is for {name} {wanted}.x (installed: {have})")
    if not wrong:
        return None
    return (
        "the torchtitan backend changes torchtitan's and torch's modules for the releases it "
        "was written for, and this session has others:\n  "
        + "\n  ".join(wrong)
        + "\ninstall the releases named above into this environment (pip install -e "
        '".[torchtitan]" in your pytest-convergence clone installs the ones it supports), or '
        "port the patches in convergence/backends/torchtitan/patches.py"
    )


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


@pinned(torchtitan="0.3", torch="2.13")
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


@pinned(torchtitan="0.3", torch="2.13")
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


@pinned(torchtitan="0.3", torch="2.13")
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
            "the torchtitan launcher on CPU: flex attention with a score_mod "
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


@pinned(torchtitan="0.3", torch="2.13")
def patch_attention() -> None:
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention.FlexAttention.compiled_flex_attn = staticmethod(eager_flex_attention)
    # The block mask built eagerly: compiling it costs ~80 s of C++ builds on a CPU.
    attention._compiled_create_block_mask = create_block_mask


# -- CPU: reductions ---------------------------------------------------------------------------


@pinned(torchtitan="0.3", torch="2.13")
def force_sum_reduction(model: Any) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


# -- the trainer: per-step records and parsed configs -------------------------------------------


@pinned(torchtitan="0.3", torch="2.13")
def record_steps(log: StepLog) -> None:
    """Record each step's batches (``Trainer.batch_generator``), gradients (just before
    torchtitan clips them, ``distributed.utils.clip_grad_norm_``, which returns the norm it
    clipped with) and update (``OptimizersContainer.step``, which the loop calls right after
    clipping), and add our norms to the scalars its TensorBoard logger writes."""
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.metrics import TensorBoardLogger
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.trainer import Trainer

    generator = Trainer.batch_generator

    def batch_generator(self: Any, data_iterable: Any) -> Iterator[Any]:
        for input_dict, labels in generator(self, data_iterable):
            log.on_batch(input_dict, labels)
            yield input_dict, labels

    Trainer.batch_generator = batch_generator
    clip = dist_utils.clip_grad_norm_
    trainer_init = Trainer.__init__
    named: list[Any] = []
    trainers: list[Any] = []

    def init(self: Any, config: Any) -> None:
        trainer_init(self, config)
        named.extend((n, p) for m in self.model_parts for n, p in m.named_parameters())
        trainers.append(self)

    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = trainers[-1]
        log.on_grads(named, trainer.parallel_dims, step=trainer.step)
        total = clip(parameters, *args, **kwargs)
        log.on_clipped(float(total), named)
        return total

    container_step = OptimizersContainer.step

    def optimizers_step(self: Any, closure: Any = None) -> Any:
        out = container_step(self, closure)
        log.on_stepped(named)
        return out

    Trainer.__init__ = init
    dist_utils.clip_grad_norm_ = clip_grad_norm_
    OptimizersContainer.step = optimizers_step
    tensorboard_log = TensorBoardLogger.log

    def log_with_ours(self: Any, metrics: dict[str, Any], step: int) -> None:
        if "grad_norm" in metrics and log.record.get("step") == step:  # a training step's line
            metrics = {**metrics, **log.tensorboard_extras()}
        tensorboard_log(self, metrics, step)

    TensorBoardLogger.log = log_with_ours


@pinned(torchtitan="0.3", torch="2.13")
def on_parsed_config(callback: Callable[[Any], None]) -> None:
    """``callback(config)`` on every config torchtitan's ``ConfigManager`` parses that has a
    model spec (before the trainer builds the model from it)."""
    from torchtitan.config import ConfigManager

    parse_args = ConfigManager.parse_args

    def parse(self: Any, args: list[str] | None = None) -> Any:
        config = parse_args(self, args)
        if getattr(config, "model_spec", None) is not None:
            callback(config)
        return config

    ConfigManager.parse_args = parse

"""The shims the launcher needs for the torch and torchtitan releases it runs, each with the
versions it is written for (``@pinned``; ``PATCHES`` lists them): the launcher and the
backend's preflight refuse other releases with a message naming each shim and its releases.
torchtitan is not forked: these module attributes are changed before its trainer is imported.
What a convergence job adds to torchtitan's training (per-step records, hooks, probe, resume,
anchors) is no shim: it is ``ConvergenceTrainer``'s methods
(convergence/backends/torchtitan/trainer_class.py), built by ``titan_main`` -- torchtitan 0.3's
``main()`` with our trainer class (0.3 has no ``main(trainer_class)``); ``ConvergenceTrainer``
itself is listed here for the torchtitan release whose loop it follows.

Everywhere (GPU and CPU):

- ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step
  (``distributed/utils.py: set_pg_timeouts``), does not exist in torch 2.13: it is given the
  function torch does have, ``distributed_c10d._set_pg_timeout`` (same arguments).
- torchtitan 0.3.0 hands its pipeline schedule microbatch lists
  (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``) that torch 2.13's schedules do not
  take (they would split the lists again as model inputs): ``step`` gains that form
  (``patch_pipeline_step``).
- torchtitan 0.3.0's ``main()`` builds ``type(config)._owner``: ``titan_main`` is that main
  building ``ConvergenceTrainer`` (the config stays the one torchtitan parsed).

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

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

PatchFn = TypeVar("PatchFn", bound=Callable[..., Any])


@dataclass(frozen=True)
class Pin:
    """The releases a patch is written for: version prefixes ("0.3" is any 0.3.x; "": any)."""

    torchtitan: str
    torch: str = ""


#: Every patch in this module -> the releases it is written for.
PATCHES: dict[str, Pin] = {}


def pinned(*, torchtitan: str, torch: str = "") -> Callable[[PatchFn], PatchFn]:
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
            if not wanted:
                continue
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


# -- torchtitan's main(), with our trainer class ------------------------------------------------

#: The launcher's Trainer subclass (trainer_class.py, which imports torchtitan: not read here)
#: overrides torchtitan 0.3's ``Trainer`` methods and relies on its loop: one
#: ``forward_backward_step`` per accumulation step before it clips, ``checkpointer.save`` after
#: every step, ``CheckpointManager._find_load_step``.
PATCHES["ConvergenceTrainer"] = Pin(torchtitan="0.3")


@pinned(torchtitan="0.3")
def titan_main(build: Callable[[Any], Any]) -> None:
    """torchtitan 0.3.0's ``torchtitan.train.main`` with ``build(config)`` in place of its
    ``config.build()``: the launcher's trainer class (convergence/backends/torchtitan/
    trainer_class.py) built from the config torchtitan parsed, everything else as torchtitan's
    own main does it (logging, structured logger, seed checkpoint, close, process group).

    Why a copy of main() and not ``config.build()``: torchtitan 0.3.0 has no
    ``main(trainer_class)`` and builds ``type(config)._owner`` -- the class whose nested
    ``Config`` the config is. Our class given its own ``Config`` would need the parsed config
    converted into it (a second config type whose ``to_dict`` and checkpoints torchtitan sees);
    building our class here leaves the config exactly the one torchtitan parsed. A torchtitan
    with ``main(trainer_class)`` replaces this function by that call."""
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.info(
        "torchtitan version: %s (0.0.0 means __version__ is not defined correctly).",
        torchtitan.__version__,
    )
    config = ConfigManager().parse_args()
    sl.init_structured_logger(
        source="training",
        output_dir=config.dump_folder,
        enable=config.debug.enable_structured_logging,
    )
    sl.log_trace_instant("structured_logger_started")
    trainer = None
    try:
        if config.comm.mode == "local_tensor":
            logger.info("Local tensor mode enabled - skipping training execution")
            return
        # What config.build() does: a shallow copy of the config, under the same trace span.
        with sl.log_trace_span(f"{type(config).__qualname__}.build"):
            trainer = build(dataclasses.replace(config))
        if config.checkpoint.create_seed_checkpoint:
            assert int(os.environ["WORLD_SIZE"]) == 1, (
                "Must create seed checkpoint using a single device, to disable sharding."
            )
            assert config.checkpoint.enable, (
                "Must enable checkpointing when creating a seed checkpoint."
            )
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            with sl.log_trace_span("torch_distributed_teardown"):
                torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")

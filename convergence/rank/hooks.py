"""The extension point: a new parallelism (or any model transformation) as a test case.

Name a function in the train config (or as an override, or in an experiment's ``hook = ...``):

    [parallelism]
    hook = "my_project.parallel:apply_my_tp"
    hook_mode = "replace_tp"        # or "after" (the default)

At collection, :func:`find_hook_module` checks that the module can be found, and the run cache
hashes its source file (:func:`locate_hook_module`), both without importing it or its parent
packages: no user code runs in the pytest process. The trainer imports it on every rank before
building anything (a missing function fails at start, naming the key) and calls it once per model chunk (one chunk without PP, one
per local stage with PP):

    def apply(model: nn.Module, ctx: HookContext) -> nn.Module | None

Return a new module to replace the chunk, or None after changing it in place.

torchtitan jobs (``backend = "torchtitan"``) get the same call, after torchtitan's own
parallelisation of each model part, in "after" mode only (collection refuses "replace_tp").
Both trainers import this module (``convergence.rank``: what runs inside a rank, for any
trainer); hooks written against its former path, ``convergence.trainer.hooks``, still import.

Modes:
- "after": called after the built-in parallelisation (TP, activation checkpointing, compile,
  FSDP/DDP) of the chunk: register tensor hooks, wrap modules, swap a kernel ...
- "replace_tp": the built-in TP plan is skipped and the hook is called in its place, on the
  still unsharded (meta-device) chunk, with ``ctx.tp_mesh``; activation checkpointing, FSDP and
  PP stay built in. Parameters the hook turns into DTensors on ``ctx.tp_mesh`` are then sharded
  by FSDP on the data-parallel mesh as usual, and the trainer's gradient norm and clipping cover
  them (it reads each DTensor's placements).

Worked example -- a hand-written tensor-parallel plan for the MLP only, as a test case against
the built-in FSDP+TP layout::

    # my_project/parallel.py
    from torch import nn
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)
    from convergence.rank.hooks import HookContext

    def apply_my_tp(model: nn.Module, ctx: HookContext) -> None:
        if ctx.tp_mesh is None:          # tp == 1: nothing to do
            return None
        for block in model.layers.values():
            parallelize_module(block.feed_forward, ctx.tp_mesh, {
                "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
        return None

    # experiments/my_tp.toml
    [[test]]
    name = "my-mlp-tp"
    parallelism = { dp_shard = 2, tp = 2 }
    hook = "my_project.parallel:apply_my_tp"
    hook_mode = "replace_tp"        # the hook is the TP plan (in "after" mode the built-in
                                    # plan would already have sharded these weights)

A hook in "after" mode that, say, scales a gradient with
``p.register_hook(lambda g: 2 * g)`` changes the measured grad norm -- exactly the kind of
bug a convergence pair is there to catch.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

from convergence.spec.errors import SpecError

if TYPE_CHECKING:
    # Types only: the collection checks find_hook_module in the pytest process, where torch is
    # never imported (convergence/torch_info.py).
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, kw_only=True)
class HookContext:
    """What a hook gets besides the model chunk."""

    mesh: Optional["DeviceMesh"]
    """The world mesh, axes ("pp", "dp_replicate", "dp_shard", "cp", "tp"); None single-process."""
    tp_mesh: Optional["DeviceMesh"]
    """The 1D tensor-parallel mesh, or None when tp == 1."""
    dp_mesh: Optional["DeviceMesh"]
    """The data-parallel mesh FSDP/DDP use (1D, or 2D (dp_replicate, dp_shard_cp) for HSDP);
    None when there is no data parallelism."""
    config: Any
    """The whole train config of this job: the built-in trainer's ``TrainConfig``
    (convergence/trainer/config.py), or for a torchtitan job torchtitan's own config object
    (its meshes fill ``mesh``/``tp_mesh``/``dp_mesh``: convergence/backends/torchtitan/
    model_parts.py)."""
    mode: str
    """"after" or "replace_tp" (see the module docstring)."""
    pp_rank: int = 0
    """This rank's pipeline rank (0 without PP)."""
    pp_size: int = 1
    """Pipeline degree."""
    stage_index: int = 0
    """Index of this chunk's pipeline stage (0 without PP)."""
    num_stages: int = 1
    """Total pipeline stages (1 without PP)."""


HookFn = Callable[["nn.Module", HookContext], Optional["nn.Module"]]


def load_hook(path: str, *, file: str | None = None) -> HookFn:
    """Import "package.module:function"; raise SpecError naming parallelism.hook if it fails."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(
            f'hook {path!r} is not "package.module:function"',
            file=file,
            key="parallelism.hook",
            fix="write it as package.module:function",
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error is the user's to see, with its cause
        raise SpecError(
            f"cannot import hook module {module_name!r}: {exc!r}",
            file=file,
            key="parallelism.hook",
            fix="make the module importable on every rank (PYTHONPATH / install)",
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SpecError(
            f"module {module_name!r} has no callable {attr!r}",
            file=file,
            key="parallelism.hook",
            fix="name an existing function after the ':'",
        )
    return cast(HookFn, fn)  # a callable: the hook's signature is the user's promise


def find_hook_module(path: str, *, file: str | None = None, key: str = "hook") -> None:
    """Check at collection that the hook's module exists where the ranks will look for it,
    *without importing it*: raise SpecError naming ``key`` if it does not.

    Why not import: importing runs the user's module-level code in the pytest process at
    collection, before anything was asked to run (and once per xdist worker). Locating it is
    enough to catch the common mistakes (a typo, a missing PYTHONPATH); the function inside is
    checked when the ranks import the module at start (:func:`load_hook`). Parent packages of a
    dotted name are not imported either: each level is looked up in its parent's folder.

    The ranks run with the session's working directory and ``PYTHONPATH``, so those are
    searched besides ``sys.path`` (and any installed finder, e.g. editable installs)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(
            f'hook {path!r} is not "package.module:function"',
            file=file,
            key=key,
            fix="write it as package.module:function",
        )
    if module_name in sys.modules:
        return  # already imported here (e.g. os.path, or the project's own package)
    parts = module_name.split(".")
    extra = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    locations: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        spec = _locate(name, locations, extra)
        if spec is None:
            where = (
                "the working directory, PYTHONPATH or sys.path"
                if depth == 1
                else (f"package {'.'.join(parts[: depth - 1])!r}")
            )
            raise SpecError(
                f"hook module {module_name!r} cannot be imported: no {name!r} in {where}",
                file=file,
                key=key,
                fix="fix the module path, or make it importable on every rank "
                "(run pytest from its folder, or set PYTHONPATH / install it)",
            )
        locations = list(spec.submodule_search_locations or [])
        if depth < len(parts) and not locations:
            raise SpecError(
                f"hook module {module_name!r}: {name!r} is a module, not a package",
                file=file,
                key=key,
                fix="fix the dotted module path",
            )


def locate_hook_module(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of the module the ranks will import for ``module_name``, found as
    :func:`find_hook_module` does -- without importing it or its parent packages -- or None.
    The run cache hashes the file it names (``spec.origin``)."""
    extra = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    locations: list[str] | None = None
    spec: importlib.machinery.ModuleSpec | None = None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        spec = _locate(".".join(parts[:depth]), locations, extra)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
        if depth < len(parts) and not locations:
            return None
    return spec


def _locate(
    name: str, parent_locations: list[str] | None, extra: list[str]
) -> importlib.machinery.ModuleSpec | None:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    if parent_locations is not None:  # a submodule: look only in the parent package's folders
        return importlib.machinery.PathFinder.find_spec(name, parent_locations)
    try:
        spec = importlib.util.find_spec(name)  # top level: nothing is executed
    except (ImportError, ValueError):
        spec = None
    return spec or importlib.machinery.PathFinder.find_spec(name, extra)


def apply_hook(fn: HookFn, model: nn.Module, ctx: HookContext) -> nn.Module:
    """Call the hook; a returned module replaces the chunk."""
    result = fn(model, ctx)
    return model if result is None else result

"""The numerics probe for torchtitan jobs: the built-in trainer's probe, with the same recorder
and reductions (convergence/rank/probe_norms.py), inside torchtitan's own training loop,
through the launcher's trainer class (``ConvergenceTrainer``,
convergence/backends/torchtitan/trainer_class.py, calls what is here).

    torchrun ... -m convergence.backends.torchtitan.launch --convergence.probe_step=K ...

(a job whose request asks for the probe of step K: convergence/run/probe.py). torchtitan
trains steps 1..K-1 as usual from the job's seed checkpoint (a replay, as the built-in trainer
does: the runs are deterministic); at step K the wrapper

1. puts forward hooks on every module of every model part (``OutputRecorder``: the full
   tensor's sum of squares, ``DTensor.full_tensor()`` for DTensor outputs, plain shards told
   from replicated copies by comparing the TP ranks' bits; ``module_sumsq``),
2. lets torchtitan run that step's forward and backward (all microbatches and accumulation
   steps: torchtitan's own data path, so a data bug shows too),
3. once the step's last backward ran (torchtitan clips the gradients next), removes the
   hooks and takes every gradient's full norm (``grad_sumsq``), the step's global loss
   (torchtitan's per-rank "sum / global tokens", summed over the loss mesh) and writes
   ``probe.json`` into the dump folder (global rank 0, after gathering the pipeline stages),
   in the format run/probe_compare.py reads;
4. ends the training loop after that step (``should_continue_training``: no exception, so
   torchtitan closes as after a normal run).

The replayed steps' losses (as TensorBoard holds them: float32) go to ``metrics.jsonl`` beside
``probe.json``, for convergence.run.probe's replay check. Names are torchtitan's module FQNs
(``layers.1.attention.wo``), the same on every layout: with PP each stage keeps the global
layer names, and its records are put in forward order by stage index.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergence.rank.meshes import Meshes
from convergence.spec.run_dir import DumpDir


def float32(value: float) -> float:
    """``value`` as TensorBoard stores it (torchtitan's ``add_scalar``: float32)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


@dataclass(kw_only=True)
class TitanProbe:
    """What the probe keeps between torchtitan's calls within one job."""

    step: int
    done: bool = False
    recorder: Any = None
    losses: list[Any] = field(default_factory=list)
    replayed: dict[int, float] = field(default_factory=dict)
    """Step -> global loss of the replayed steps, on the ranks that hold the loss."""


def recorder_class() -> Any:
    """The probes' ``OutputRecorder``, with its hooks paused while ``inferring``."""
    from convergence.rank.probe_norms import OutputRecorder  # lazy: torch

    class TitanRecorder(OutputRecorder):
        # torch 2.13's pipeline stages run each stage's forward once more at a schedule's first
        # step, to infer the shapes they send (``_forward_metadata_inference``, on the real
        # microbatch or on empty buffers): those calls are no part of the step.
        inferring = False

        def _hook(self, name: str) -> Any:
            record = super()._hook(name)

            def hook(module: Any, args: Any, output: Any) -> None:
                if not self.inferring:
                    record(module, args, output)

            return hook

    return TitanRecorder


def pause_during_inference(trainer: Any, recorder: Any) -> None:
    """Pause ``recorder`` while a pipeline stage infers its metadata (``recorder_class``)."""
    if not trainer.parallel_dims.pp_enabled:
        return
    schedule = trainer.pp_schedule
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        infer = stage._forward_metadata_inference

        def paused(*args: Any, _infer: Any = infer, **kwargs: Any) -> Any:
            recorder.inferring = True
            try:
                return _infer(*args, **kwargs)
            finally:
                recorder.inferring = False

        stage._forward_metadata_inference = paused  # this stage object only


def holds_loss(trainer: Any) -> bool:
    return not trainer.parallel_dims.pp_enabled or bool(trainer.pp_has_last_stage)


def meshes_of(parallel_dims: Any) -> Meshes:
    """torchtitan's ParallelDims as the probes' ``Meshes`` (what they read: tp, cp, pp, the
    loss mesh as dp x cp, the batch mesh as data)."""
    optional = parallel_dims.get_optional_mesh
    return Meshes(
        world=parallel_dims.world_mesh,
        tp=optional("tp"),
        cp=optional("cp"),
        pp=optional("pp"),
        dp=None,
        dp_kind="fsdp",
        dp_cp=optional("loss", include_singleton_axes=True),
        data=optional("batch", include_singleton_axes=True),
    )


def stage_chunks(trainer: Any) -> list[tuple[int, Any]]:
    """The trainer's model parts with their pipeline stage index (0 without PP)."""
    if not trainer.parallel_dims.pp_enabled:
        return [(0, part) for part in trainer.model_parts]
    schedule = trainer.pp_schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [
        (stage.stage_index, part) for stage, part in zip(stages, trainer.model_parts, strict=True)
    ]


def global_loss(trainer: Any, losses: list[Any], meshes: Meshes) -> float | None:
    """The step's loss over the global batch: each rank's "local sum / global tokens" summed
    over its accumulation steps and over the loss mesh (dp x cp); None where no rank of this
    pipeline stage holds it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not holds_loss(trainer) or not losses:
        return None
    values = [x.full_tensor() if isinstance(x, DTensor) else x for x in losses]
    total = torch.stack([v.detach().double().reshape(()) for v in values]).sum()
    if meshes.dp_cp.size() > 1:
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
    return float(total.item())


def write_probe(probe: TitanProbe, trainer: Any) -> None:
    """Step 3 of the module docstring: gradients, loss, probe.json (rank 0)."""
    import torch
    import torch.distributed as dist

    from convergence.rank.probe_norms import (  # lazy: torch
        PROBE_VERSION,
        gather_over_stages,
        grad_sumsq,
        in_forward_order,
        module_sumsq,
    )

    probe.recorder.remove()
    meshes = meshes_of(trainer.parallel_dims)
    device = torch.device(trainer.device)
    modules = module_sumsq(probe.recorder, meshes, device)
    grads = grad_sumsq(stage_chunks(trainer), device)
    loss = global_loss(trainer, probe.losses, meshes)
    replayed = probe.replayed if holds_loss(trainer) else {}
    gathered = gather_over_stages((modules, grads, loss, replayed), meshes)
    if dist.get_rank() != 0:
        return
    config = trainer.config
    data = {
        "version": PROBE_VERSION,
        "step": probe.step,
        "param_dtype": str(config.training.mixed_precision_param),
        "layout": {
            "dp_replicate": trainer.parallel_dims.dp_replicate,
            "dp_shard": trainer.parallel_dims.dp_shard,
            "tp": trainer.parallel_dims.tp,
            "cp": trainer.parallel_dims.cp,
            "pp": trainer.parallel_dims.pp,
        },
        "loss": next((g[2] for g in gathered if g[2] is not None), None),
        "modules": in_forward_order([row for g in gathered for row in g[0]], with_calls=True),
        "grads": in_forward_order([row for g in gathered for row in g[1]], with_calls=False),
    }
    dump = DumpDir(Path(config.dump_folder))
    dump.path.mkdir(parents=True, exist_ok=True)
    steps: dict[int, float] = next((g[3] for g in gathered if g[3]), {})
    # The replayed losses, where convergence.run.probe reads them beside probe.json.
    dump.metrics.write_text(
        "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in sorted(steps.items()))
    )
    tmp = dump.probe.with_name(dump.probe.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(dump.probe)


def start_recording(probe: TitanProbe, trainer: Any) -> None:
    """Step 1 of the module docstring, as torchtitan's step K begins."""
    probe.recorder = recorder_class()(stage_chunks(trainer))
    pause_during_inference(trainer, probe.recorder)

"""The numerics probe: one forward+backward, every module's output norm and every gradient norm.

    torchrun ... -m convergence.trainer --config X.toml --probe.enable=true --probe.step=K

The trainer trains steps 1..K-1 as usual (the same loop, data, LR schedule and optimizer as the
run being probed), then, in place of step K, runs ONE optimizer step's worth of forward+backward
(all microsteps, all microbatches) on the batch of step K, writes `probe.json` to the dump
folder (from the rank that logs the loss) and stops. K = 1 probes the seed weights.

Why replay rather than a checkpoint of step K-1: the step to probe (the first divergent one) is
only known after the run, so a checkpoint would have to be saved at every step; runs are
deterministic (same seed checkpoint, same samples, deterministic kernels), so K-1 steps of the
same loop rebuild that state exactly -- the replayed steps' metrics (metrics.jsonl beside
probe.json) equal the run's, which convergence.run.probe checks -- for the cost of K steps.

    {"version": 1, "step": 1, "param_dtype": "float32", "layout": {...},
     "loss": 5.54, "dp_losses": [5.55, 5.53],                  # per data-parallel rank
     "modules": [{"name": "tok_embeddings", "norm": 181.0, "calls": 1}, ...],  # forward order
     "grads":   [{"name": "tok_embeddings.weight", "norm": 0.012}, ...]}       # forward order

The numbers and why each is layout independent (full-tensor norms, TP shards told from
copies by their bits, wrapper segments dropped from names, forward order): convergence/rank/
probe_norms.py, which the torchtitan launcher's probe (convergence/backends/torchtitan/probe.py)
records and reduces with too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from convergence.rank.meshes import Meshes
from convergence.rank.probe_norms import (
    PROBE_VERSION,
    OutputRecorder,
    all_gather_into,
    gather_over_stages,
    grad_sumsq,
    in_forward_order,
    module_sumsq,
)
from convergence.spec.run_dir import DumpDir
from convergence.trainer import pp_rules
from convergence.trainer.config import TrainConfig
from convergence.trainer.engines import Engine
from convergence.trainer.metrics_writer import RunStatus


def dp_losses(local_loss: torch.Tensor | None, meshes: Meshes | None) -> list[float] | None:
    """Loss of each data-parallel rank (CP chunks averaged first), on the ranks holding it."""
    if local_loss is None:
        return None
    loss = local_loss.detach().double().reshape(1)
    if meshes is None:
        return [float(loss.item())]
    if meshes.cp is not None:
        dist.all_reduce(loss, group=meshes.cp.get_group())
        loss = loss / meshes.cp.size()
    size = meshes.data.size()
    if size == 1:
        return [float(loss.item())]
    gathered = torch.empty(size, dtype=loss.dtype, device=loss.device)
    all_gather_into(gathered, loss, group=meshes.data.get_group())
    return [float(v) for v in gathered.tolist()]


def stage_chunks(
    chunks: list[nn.Module], cfg: TrainConfig, meshes: Meshes | None
) -> list[tuple[int, nn.Module]]:
    """The engine's chunks with their pipeline stage index (0 without PP)."""
    if meshes is None or meshes.pp is None:
        return [(0, chunk) for chunk in chunks]
    par = cfg.parallelism
    ids = pp_rules.stage_ids(
        meshes.pp.get_local_rank(), par.pp, par.stages_per_rank, par.pp_schedule
    )
    return list(zip(ids, chunks, strict=True))


def probe_step(cfg: TrainConfig) -> int | None:
    """The step the numerics probe replaces, None without one."""
    if cfg.probe.enable and 1 <= cfg.probe.step <= cfg.training.steps:
        return cfg.probe.step
    return None


def run_probe(
    cfg: TrainConfig,
    engine: Engine,
    meshes: Meshes | None,
    forward_backward: Callable[[], torch.Tensor],
    device: torch.device,
    *,
    is_writer: bool,
    warm_up: bool = True,
) -> RunStatus:
    """One forward+backward on the batch of ``cfg.probe.step``; probe.json from the writer.

    Called by the training loop in place of step ``cfg.probe.step``, so the weights and the
    optimizer are those the run had there. ``forward_backward``: the training loop's own data
    path for that step (its batches, token weight and microsteps: a data bug shows here too),
    returning this rank's loss; handed in so that this module needs nothing of the loop.
    ``warm_up``: whether a pipeline schedule still has its first (shape-inferring) call ahead,
    i.e. the probe is at step 1.
    """
    step = cfg.probe.step
    chunks = stage_chunks(engine.chunks, cfg, meshes)

    if warm_up and meshes is not None and meshes.pp is not None:
        # A pipeline schedule's first step also runs each stage's forward once more to infer
        # the shapes it sends (on a real microbatch, or on uninitialised buffers): a warm-up
        # step, whose gradients are dropped, keeps those calls out of the records.
        forward_backward()
        for _, chunk in chunks:
            for param in chunk.parameters():
                param.grad = None
    recorder = OutputRecorder(chunks)
    local_loss = forward_backward()
    recorder.remove()
    losses = dp_losses(local_loss if engine.holds_loss else None, meshes)
    modules = module_sumsq(recorder, meshes, device)
    grads = grad_sumsq(chunks, device)
    gathered = gather_over_stages((modules, grads), meshes)
    if not is_writer:
        return "finished"
    all_modules = [row for mods, _ in gathered for row in mods]
    all_grads = [row for _, gs in gathered for row in gs]
    data = {
        "version": PROBE_VERSION,
        "step": step,
        "param_dtype": cfg.training.param_dtype,
        "layout": cfg.parallelism.to_dict(),
        "loss": sum(losses) / len(losses) if losses else None,
        "dp_losses": losses,
        "modules": in_forward_order(all_modules, with_calls=True),
        "grads": in_forward_order(all_grads, with_calls=False),
    }
    dump = DumpDir(Path(cfg.metrics.dump_folder))
    dump.path.mkdir(parents=True, exist_ok=True)
    tmp = dump.probe.with_name(dump.probe.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(dump.probe)
    return "finished"

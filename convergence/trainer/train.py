"""The training loop of the reference trainer. Read it top to bottom.

    torchrun --standalone --nproc-per-node N -m convergence.trainer --config X.toml [--a.b=c ...]

Every layout (DDP, FSDP, HSDP, TP, SP, PP, CP, their products) runs this same loop on the same
samples from the same weights, so the loss and the gradient norm of step s are the same numbers
up to floating-point reduction order. That is what a convergence pair compares.

What the loop calls, by module: world.py (this process, its device and process group),
engines.py (the model on this rank and its forward/backward, whatever the layout), loss.py
(the global token-mean loss), optim.py (AdamW, the LR schedule, the gradient norms), resume.py
(the training checkpoint and where a resumed run starts), record.py (run_meta.json and the
metrics lines), stopping.py (the save and stop steps), probe.py (the numerics probe).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from convergence.phase_marks import mark
from convergence.rank.hooks import load_hook
from convergence.rank.meshes import Meshes
from convergence.rank.rounding_draw import apply_rounding_draw, rounding_draw
from convergence.spec.errors import SpecError
from convergence.trainer import anchors, precision, resume
from convergence.trainer import checkpoint as ckpt
from convergence.trainer.config import TrainConfig
from convergence.trainer.config_checks import check_config
from convergence.trainer.data import TRAIN, BatchPlan, SampleSource, build_source, read_step
from convergence.trainer.engines import Engine, build_engine, microsteps, validation_loss
from convergence.trainer.forward_noise import add_tp_rounding
from convergence.trainer.metrics_writer import RunStatus
from convergence.trainer.model import ModelArgs, build_model
from convergence.trainer.moe_step import MoEStep
from convergence.trainer.optim import build_optimizer, lr_at, model_parts, optimizer_step, set_lr
from convergence.trainer.parallelize import build_meshes
from convergence.trainer.probe import probe_step, run_probe
from convergence.trainer.record import CollectiveCounter, RunRecord, is_logger, step_seconds
from convergence.trainer.step_clock import set_step
from convergence.trainer.stopping import SaveAndStop
from convergence.trainer.world import (
    average_over,
    check_shared_gpu,
    data_group,
    init_distributed,
    pick_device,
    set_determinism,
)


def train(cfg: TrainConfig) -> RunStatus:
    """Train per `cfg` on this process's share of the world; returns the final status."""
    # This process: its device, the process group, the checks that need the world, the seed.
    device = pick_device(cfg)
    distributed = init_distributed(device)
    mark("process_group")
    check_config(cfg, dist.get_world_size() if distributed else 1)
    if distributed and device.type == "cuda" and dist.get_backend() == "gloo":
        check_shared_gpu(cfg)
    hook = load_hook(cfg.parallelism.hook, file=cfg.source) if cfg.parallelism.hook else None
    set_determinism(cfg, device)
    meshes = build_meshes(cfg, device.type) if distributed else None

    # The data: which global samples each step reads on this data-parallel rank (data.py).
    plan = BatchPlan(
        local_batch_size=cfg.training.local_batch_size,
        dp=cfg.parallelism.dp,
        dp_rank=meshes.data.get_local_rank() if meshes is not None else 0,
        grad_accum_steps=cfg.training.grad_accum_steps,
    )
    source = build_source(cfg)

    # The model: this rank's chunks from the seed weights, in the engine the layout needs; the
    # optimizer over their parameters.
    model_args = ModelArgs.from_config(cfg.model, seq_len=cfg.data.seq_len)
    engine = build_engine(cfg, model_args, meshes, hook, device)
    if cfg.training.forward_noise:
        # the forward-noise twin (trainer/forward_noise.py), rounding as TP of this degree
        add_tp_rounding(engine.chunks, cfg.training.forward_noise_tp)
    # Another machine's rounding when the session asks for one (rounding_draw.py): the same
    # deterministic function of the numbers in every job, so the suite can find a test that
    # holds only for this machine's draw.
    apply_rounding_draw(engine.chunks, rounding_draw())
    named_params = [(n, p) for chunk in engine.chunks for n, p in chunk.named_parameters()]
    parts = model_parts(build_model(model_args, "meta"))
    optimizer = build_optimizer([p for _, p in named_params], cfg)
    pp_group = meshes.pp.get_group() if meshes is not None and meshes.pp is not None else None
    # MoE models: the balance loss's weight, and the step's routing over all ranks (moe_step).
    moe_step = MoEStep.build(cfg, model_args, engine, meshes, plan, device)

    # The record: run_meta.json and a metrics line per logged step, from one rank (record.py);
    # the collectives of one step are counted for it.
    counter = CollectiveCounter(cfg)
    record = RunRecord(
        cfg=cfg,
        is_writer=is_logger(engine, meshes),
        distributed=distributed,
        device=device,
        plan=plan,
        source=source,
        model_args=model_args,
        parts=parts,
        counter=counter,
    )
    # Step 1, or the step after the checkpoint a resume loads (resume.py).
    run = resume.Checkpointable(
        chunks=engine.chunks,
        named_params=named_params,
        optimizer=optimizer,
        cfg=cfg,
        global_batch_size=plan.global_batch_size,
        device=device,
    )
    position = resume.start_position(run, plan)
    step = position.first_step - 1  # the last step taken
    record.begin(step)
    save_and_stop = SaveAndStop(run, distributed=distributed)
    # The numerics probe replaces step K: the loop trains up to K - 1.
    probe_at = probe_step(cfg)
    last_step = probe_at - 1 if probe_at else cfg.training.steps
    status: RunStatus = "failed"
    mark("steps_begin")
    try:
        status = "finished"
        for step in anchors.loop_steps(cfg, position.first_step, last_step):
            step_start = time.perf_counter()
            # An anchored job starts each of its steps from the control's state (anchors.py).
            position = anchors.load_anchor(run, step, plan) or position
            set_step(step)
            lr = lr_at(position.lr_step(step), cfg)
            set_lr(optimizer, lr)

            # The step's batches, its global valid-token count (-> the loss weight) and its
            # data fingerprint; then forward/backward over the microsteps into .grad.
            data = read_step(source, position.plan, step, TRAIN, device, data_group(meshes))
            engine.weight.use(data.num_tokens)
            local_loss = microsteps(
                counter.around(step, engine.forward_backward), data.batches, device
            )
            # Clip and step; the gradient's norms before clipping, and the norms of the update
            # the optimizer applied (optim.update_norms: a clipping or LR bug shows there).
            norms = optimizer_step(optimizer, named_params, parts, pp_group, cfg.training.max_norm)
            precision.after_optimizer_step(engine.chunks, cfg)  # float8 all-gather's scales
            # MoE: the step's tokens per expert per layer, summed over the ranks (and the
            # expert-bias update that follows from them); {} for a dense model.
            routing = moe_step.after_step() if moe_step is not None else {}

            # Every dp x cp rank holds (D/N) * its token-loss sum: their mean is the global mean.
            global_loss = average_over(local_loss, meshes) if engine.holds_loss else None
            val_loss = None
            if cfg.metrics.val_every and step % cfg.metrics.val_every == 0:
                val_loss = validation_loss(engine, source, plan, meshes, cfg, device)
            record.log_step(
                step,
                loss=global_loss,
                norms=norms,
                lr=lr,
                seconds=step_seconds(step_start, device),
                data_fingerprint=data.fingerprint,
                val_loss=val_loss,
                extra=routing,
            )

            # The save and stop steps (stopping.py): the run may end here.
            ended = save_and_stop.after(step, position)
            if ended is not None:
                status = ended
                break
        if probe_at is not None and status == "finished":
            step = probe_at
            status = probe(cfg, engine, source, plan, meshes, device, is_writer=record.is_writer)
    except BaseException:
        status = "failed"
        raise
    finally:
        mark("steps_end")
        record.end(status, step)
        if distributed:
            dist.destroy_process_group()
    return status


def probe(
    cfg: TrainConfig,
    engine: Engine,
    source: SampleSource,
    plan: BatchPlan,
    meshes: Meshes | None,
    device: torch.device,
    *,
    is_writer: bool,
) -> RunStatus:
    """The numerics probe in place of step K (probe.step): one forward+backward, norms to
    probe.json, then stop. Steps before it ran the loop, so the probe sees exactly the state
    this run had at this step (same data, LR, optimizer)."""
    step = cfg.probe.step
    set_step(step)

    def probe_forward_backward() -> torch.Tensor:
        # The loop's own data path (read_step + the token weight): the probe sees the
        # very batches the step would have trained on.
        data = read_step(source, plan, step, TRAIN, device, data_group(meshes))
        engine.weight.use(data.num_tokens)
        return microsteps(engine.forward_backward, data.batches, device)

    return run_probe(
        cfg, engine, meshes, probe_forward_backward, device, is_writer=is_writer, warm_up=step == 1
    )


def create_seed(cfg: TrainConfig) -> str:
    """`--checkpoint.create_seed_checkpoint=true`: write the seed checkpoint, one process."""
    check_config(cfg, None)
    folder = cfg.checkpoint.seed_checkpoint
    if not folder:
        raise SpecError(
            "no folder to create the seed checkpoint in",
            file=cfg.source,
            key="checkpoint.seed_checkpoint",
            fix="set --checkpoint.seed_checkpoint=DIR",
        )
    model_args = ModelArgs.from_config(cfg.model, seq_len=cfg.data.seq_len)
    return ckpt.create_seed_checkpoint(model_args, cfg.training.seed, folder)

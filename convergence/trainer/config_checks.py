"""Checks of a TrainConfig against the model and the world size, before anything is built.

The library calls `check_config` at collection time (no process group, no torch.distributed),
and the trainer calls it again at start, so a bad layout fails in seconds, naming the key.
"""

from __future__ import annotations

from typing import Callable, NoReturn

from convergence.spec.errors import SpecError
from convergence.spec.job import HOOK_MODES
from convergence.spec.layout import AC_MODES, DTYPES, FLOAT8_RECIPES
from convergence.trainer import pp_rules
from convergence.trainer.blocks import BLOCK_KINDS, parse_block_pattern
from convergence.trainer.config import (
    DATA_SOURCES,
    DECAY_TYPES,
    DEVICES,
    KERNELS,
    OPTIMIZERS,
    TrainConfig,
)
from convergence.trainer.moe_rules import check_moe

#: fail(key, message, fix) raises the SpecError.
Fail = Callable[[str, str, str], NoReturn]


def stages_per_rank(cfg: TrainConfig) -> int:
    """pp_stages_per_rank resolved: unset means 2 for multi-stage schedules, else 1."""
    par = cfg.parallelism
    return pp_rules.stages_per_rank(par.pp_schedule, par.pp_stages_per_rank, par.pp)


def pp_microbatches(cfg: TrainConfig) -> int:
    """pp_microbatches resolved: unset means one per stage (pp * stages per rank)."""
    par = cfg.parallelism
    return pp_rules.microbatches(par.pp, stages_per_rank(cfg), par.pp_microbatches)


def world_size_of(cfg: TrainConfig) -> int:
    par = cfg.parallelism
    return par.dp_replicate * par.dp_shard * par.tp * par.pp * par.cp


def check_config(cfg: TrainConfig, world_size: int | None = None) -> None:
    """Raise SpecError naming the first violated key, its constraint and a fix."""
    file = cfg.source or None
    model, par, train, data = cfg.model, cfg.parallelism, cfg.training, cfg.data

    def fail(key: str, message: str, fix: str) -> NoReturn:
        raise SpecError(message, file=file, key=key, fix=fix)

    for key in ("dp_replicate", "dp_shard", "tp", "pp", "cp"):
        if getattr(par, key) < 1:
            fail(f"parallelism.{key}", "must be >= 1", f"set parallelism.{key} to 1 or more")
    for key, value in (
        ("model.dim", model.dim),
        ("model.n_layers", model.n_layers),
        ("model.n_heads", model.n_heads),
        ("model.n_kv_heads", model.n_kv_heads),
        ("model.vocab_size", model.vocab_size),
        ("data.seq_len", data.seq_len),
        ("training.steps", train.steps),
        ("training.local_batch_size", train.local_batch_size),
        ("training.grad_accum_steps", train.grad_accum_steps),
    ):
        if value < 1:
            fail(key, f"must be >= 1, got {value}", f"set {key} to a positive integer")
    if model.n_heads % model.n_kv_heads:
        fail(
            "model.n_kv_heads",
            f"n_kv_heads={model.n_kv_heads} must divide n_heads={model.n_heads}",
            "pick n_kv_heads among the divisors of n_heads",
        )
    if model.dim % model.n_heads or (model.dim // model.n_heads) % 2:
        fail(
            "model.n_heads",
            f"dim={model.dim} / n_heads={model.n_heads} must be an even "
            "integer head size (rotary rotates pairs)",
            "pick n_heads so dim/n_heads is even",
        )
    _check_blocks(cfg, fail)
    check_moe(cfg, fail)
    if model.name != "llama":
        fail("model.name", f"unknown model {model.name!r}", 'use "llama"')
    if par.tp > 1:
        for key, heads in (
            ("model.n_heads", model.n_heads),
            ("model.n_kv_heads", model.n_kv_heads),
        ):
            if heads % par.tp:
                fail(
                    "parallelism.tp",
                    f"tp={par.tp} must divide {key}={heads} (each TP rank holds whole heads)",
                    f"choose tp among the divisors of {heads}",
                )
        if cfg.model.ffn_hidden_dim and cfg.model.ffn_hidden_dim % par.tp:
            fail(
                "parallelism.tp",
                f"tp={par.tp} must divide model.ffn_hidden_dim",
                "choose tp dividing ffn_hidden_dim",
            )
    if par.sequence_parallel and par.tp == 1:
        fail(
            "parallelism.sequence_parallel",
            "sequence parallel needs tp > 1",
            "set parallelism.tp >= 2 or sequence_parallel = false",
        )
    if par.sequence_parallel and (data.seq_len // par.cp) % par.tp:
        fail(
            "parallelism.sequence_parallel",
            f"tp={par.tp} must divide the local sequence length {data.seq_len // par.cp}",
            "choose seq_len divisible by tp*cp",
        )
    if model.tie_embeddings and (par.tp > 1 or par.pp > 1 or par.dp_shard * par.cp > 1):
        fail(
            "model.tie_embeddings",
            "tied embeddings are supported single-process and with "
            "DDP only (not with FSDP, TP or PP sharding)",
            "set model.tie_embeddings = false",
        )
    if data.seq_len % par.cp:
        fail(
            "parallelism.cp",
            f"cp={par.cp} must divide data.seq_len={data.seq_len}",
            "choose cp among the divisors of seq_len",
        )
    if data.source not in DATA_SOURCES:
        fail("data.source", f"unknown source {data.source!r}", 'use "synthetic" or "text"')
    if data.source == "text" and not data.path:
        fail("data.path", "the text source needs a file", "set data.path to a local text file")
    if data.source == "text" and data.tokenizer == "byte" and model.vocab_size < 256:
        fail("model.vocab_size", "byte-level text needs vocab_size >= 256", "set it to 256")
    _check_pp(cfg, fail)
    _check_techniques(cfg, fail)
    _check_precision(cfg, fail)
    _check_resume(cfg, fail)
    # Last, so a degree that cannot work at all is reported as such, not as a count mismatch.
    size = world_size_of(cfg)
    if world_size is not None and size != world_size:
        fail(
            "parallelism",
            f"dp_replicate*dp_shard*tp*pp*cp = {size} but the world size is {world_size}",
            "make the product of the degrees equal the number of processes",
        )


def _check_blocks(cfg: TrainConfig, fail: Fail) -> None:
    """Block kinds of model.block_pattern, and what "parallel" blocks need."""
    model, par = cfg.model, cfg.parallelism
    kinds = parse_block_pattern(model.block_pattern, model.n_layers)
    for kind in kinds:
        if kind not in BLOCK_KINDS:
            fail(
                "model.block_pattern",
                f"unknown block kind {kind!r}",
                f"use kinds among {', '.join(BLOCK_KINDS)} (comma-separated, repeated over "
                "the layers)",
            )
    if "parallel" not in kinds:
        return
    groups = model.parallel_groups
    if groups < 1:
        fail("model.parallel_groups", f"must be >= 1, got {groups}", "set it to 2 or more")
    for key, size in (
        ("model.dim", model.dim),
        ("model.n_heads", model.n_heads),
        ("model.n_kv_heads", model.n_kv_heads),
    ):
        if size % groups:
            fail(
                "model.parallel_groups",
                f"parallel_groups={groups} must divide {key}={size} "
                "(each slice of a parallel block holds whole heads)",
                f"choose parallel_groups among the divisors of {size}",
            )
    if groups % par.tp:
        fail(
            "model.parallel_groups",
            f"tp={par.tp} must divide parallel_groups={groups} "
            "(each TP rank computes whole slices of a parallel block, without communication)",
            f"set model.parallel_groups to a multiple of {par.tp}",
        )
    if par.sequence_parallel:
        # The residual stream of a parallel block is sharded on the hidden dim; with SP it is
        # sequence-sharded elsewhere, and switching between the two is an all-to-all that the
        # built-in plan does not do.
        fail(
            "parallelism.sequence_parallel",
            '"parallel" blocks (model.block_pattern) do not support sequence parallel',
            "set sequence_parallel = false, or use standard/single_sync blocks only",
        )


def _check_pp(cfg: TrainConfig, fail: Fail) -> None:
    """The PP rules (pp_rules.layout_problem): the same ones the trainer builds stages by."""
    par = cfg.parallelism
    problem = pp_rules.layout_problem(
        schedule=par.pp_schedule,
        pp=par.pp,
        stages_configured=par.pp_stages_per_rank,
        microbatches_configured=par.pp_microbatches,
        n_layers=cfg.model.n_layers,
        local_batch_size=cfg.training.local_batch_size,
        data_parallel=par.dp_replicate * par.dp_shard * par.cp,
    )
    if problem is not None:
        fail(problem.key, problem.message, problem.fix)


def _check_precision(cfg: TrainConfig, fail: Fail) -> None:
    """The [precision] section (trainer/precision.py applies it)."""
    prec, par = cfg.precision, cfg.parallelism
    if prec.float8 not in FLOAT8_RECIPES:
        fail(
            "precision.float8",
            f"unknown recipe {prec.float8!r}",
            f"use one of {', '.join(FLOAT8_RECIPES)}",
        )
    if prec.kernels not in KERNELS:
        fail(
            "precision.kernels",
            f"unknown choice {prec.kernels!r}",
            f"use one of {', '.join(KERNELS)}",
        )
    if prec.mxfp8 and prec.float8 != "none":
        fail(
            "precision.mxfp8",
            "mxfp8 and float8 both convert the linear layers",
            'choose one: precision.float8 = "none" or precision.mxfp8 = false',
        )
    if prec.float8_all_gather and prec.float8 != "tensorwise":
        fail(
            "precision.float8_all_gather",
            "float8 all-gather casts each weight with one scale per tensor",
            'set precision.float8 = "tensorwise", or float8_all_gather = false',
        )
    if prec.float8_all_gather and par.dp_shard * par.cp == 1:
        fail(
            "precision.float8_all_gather",
            "float8 all-gather is FSDP2's, and this layout has no FSDP (dp_shard*cp = 1)",
            "set parallelism.dp_shard >= 2, or float8_all_gather = false",
        )
    if (prec.float8 != "none" or prec.mxfp8) and par.tp > 1:
        # torchao's float8 TP needs its own parallel styles (Float8ColwiseParallel, ...) in
        # place of the built-in TP plan's; without them a DTensor weight meets a float8 cast
        # that does not know its placement.
        fail(
            "parallelism.tp",
            "the built-in trainer's float8/mxfp8 linears are not tensor parallel (tp > 1)",
            "use tp = 1 with float8/mxfp8 (FSDP, HSDP, CP and PP work), or a replace_tp hook "
            "with torchao's float8 parallel styles",
        )


def _check_techniques(cfg: TrainConfig, fail: Fail) -> None:
    train, par, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(train, key) not in DTYPES:
            fail(
                f"training.{key}",
                f"unknown dtype {getattr(train, key)!r}",
                f"use one of {', '.join(DTYPES)}",
            )
    if not 0.0 <= train.forward_noise < 0.1:
        fail(
            "training.forward_noise",
            f"{train.forward_noise} is not a rounding-level amplitude",
            "use 0 (off) or a relative amplitude below 0.1 (bf16 rounding: 0.0039)",
        )
    if train.forward_noise_tp < 2:
        fail(
            "training.forward_noise_tp",
            f"{train.forward_noise_tp} is not a TP degree the twin can round as",
            "use 2 (the default) or the test's TP degree",
        )
    if ac.mode not in AC_MODES:
        fail(
            "activation_checkpoint.mode",
            f"unknown mode {ac.mode!r}",
            f"use one of {', '.join(AC_MODES)}",
        )
    if ac.mode == "selective" and ac.selective_layer_freq < 1:
        fail("activation_checkpoint.selective_layer_freq", "must be >= 1", "set it to 1 or more")
    if train.device not in DEVICES:
        fail("training.device", f"unknown device {train.device!r}", "use auto, cpu or cuda")
    if par.dp_shard * par.cp == 1:
        # Mixed precision is FSDP2's MixedPrecisionPolicy; DDP and TP/PP without FSDP have no
        # such policy, so a bf16 request there would silently train in fp32.
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(train, key) != "float32":
                fail(
                    f"training.{key}",
                    f"{getattr(train, key)} is applied through FSDP2 "
                    "(MixedPrecisionPolicy), and this layout has no FSDP (dp_shard*cp = 1): it "
                    "would silently train in float32",
                    "set parallelism.dp_shard >= 2 (FSDP/HSDP), or keep float32 here",
                )
    if train.cpu_offload and par.dp_shard * par.cp == 1:
        fail(
            "training.cpu_offload",
            "CPU offload is an FSDP feature and needs dp_shard*cp > 1",
            "set parallelism.dp_shard >= 2 or cpu_offload = false",
        )
    if cfg.optimizer.name not in OPTIMIZERS:
        fail("optimizer.name", f"unknown optimizer {cfg.optimizer.name!r}", 'use "AdamW"')
    if cfg.lr_scheduler.decay_type not in DECAY_TYPES:
        fail(
            "lr_scheduler.decay_type",
            f"unknown decay {cfg.lr_scheduler.decay_type!r}",
            "use cosine, linear or none",
        )
    if par.hook and ":" not in par.hook:
        fail(
            "parallelism.hook",
            f'hook {par.hook!r} is not "package.module:function"',
            "write it as package.module:function",
        )
    if par.hook_mode not in HOOK_MODES:
        fail(
            "parallelism.hook_mode",
            f"unknown mode {par.hook_mode!r}",
            'use "after" or "replace_tp"',
        )
    if par.hook_mode == "replace_tp" and not par.hook:
        fail("parallelism.hook_mode", "replace_tp needs a hook", "set parallelism.hook")
    if cfg.metrics.log_freq < 1:
        fail("metrics.log_freq", "must be >= 1", "set it to 1 or more")


def _check_resume(cfg: TrainConfig, fail: Fail) -> None:
    """The training checkpoint keys (convergence.trainer.resume)."""
    ckpt, steps = cfg.checkpoint, cfg.training.steps
    if ckpt.save_at_step and not 1 <= ckpt.save_at_step < steps:
        fail(
            "checkpoint.save_at_step",
            f"save_at_step={ckpt.save_at_step} is not inside the run (1..{steps - 1})",
            f"set it between 1 and training.steps - 1 = {steps - 1}",
        )
    if ckpt.save_at_step and not ckpt.save_folder:
        fail(
            "checkpoint.save_folder",
            "save_at_step needs a folder to write into",
            "set --checkpoint.save_folder=DIR",
        )
    if (ckpt.save_at_step or ckpt.anchor_every or ckpt.anchored_from) and cfg.probe.enable:
        fail(
            "probe.enable",
            "the numerics probe replays a run (from step 1, or from a resume_from "
            "checkpoint); it does not save training checkpoints or run anchored steps",
            "drop the checkpoint keys from the probe",
        )
    if ckpt.anchor_every < 0:
        fail("checkpoint.anchor_every", "must be >= 0", "set it to N >= 1, or 0 for none")
    if ckpt.confirming_anchors and ckpt.anchor_every < 2:
        fail(
            "checkpoint.confirming_anchors",
            f"needs anchor_every >= 2 (got {ckpt.anchor_every}): it adds the state after each "
            "anchor's next step",
            "set checkpoint.anchor_every = N >= 2, or drop confirming_anchors",
        )
    if ckpt.anchored_steps < 1:
        fail(
            "checkpoint.anchored_steps",
            f"must be >= 1, got {ckpt.anchored_steps}",
            "set it to the number of steps to train from each anchor (1 for one)",
        )
    if ckpt.anchored_from and (ckpt.resume_from or ckpt.save_at_step):
        fail(
            "checkpoint.anchored_from",
            "anchored steps load their own checkpoints: no resume_from or save_at_step",
            "drop resume_from and save_at_step from the anchored job",
        )

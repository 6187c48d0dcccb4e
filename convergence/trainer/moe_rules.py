"""The checks of the MoE keys of [model] and of parallelism.ep, without torch (collection).

Called by config_checks.check_config, so a layout EP cannot run fails at collection, naming
the key and the fix, before any job starts (and again when the trainer starts).
"""

from __future__ import annotations

from typing import Callable, NoReturn

from convergence.trainer.blocks import parse_block_pattern
from convergence.trainer.config import TrainConfig

SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")

Fail = Callable[[str, str, str], NoReturn]


def check_moe(cfg: TrainConfig, fail: Fail) -> None:
    model, par = cfg.model, cfg.parallelism
    if par.ep < 1:
        fail("parallelism.ep", "must be >= 1", "set parallelism.ep to 1 or more")
    if model.n_experts < 0:
        fail("model.n_experts", "must be >= 0", "set it to 0 (dense) or the number of experts")
    if model.n_experts == 0:
        if par.ep > 1:
            fail(
                "parallelism.ep",
                f"ep={par.ep} on a dense model: expert parallelism shards the experts of a "
                "mixture of experts, and model.n_experts = 0",
                "set model.n_experts (e.g. 8) in the train config, or drop ep",
            )
        return
    if not 1 <= model.top_k <= model.n_experts:
        fail(
            "model.top_k",
            f"top_k={model.top_k} must be between 1 and n_experts={model.n_experts}",
            f"set model.top_k to at most {model.n_experts}",
        )
    if model.score_func not in SCORE_FUNCS:
        fail(
            "model.score_func",
            f"unknown score function {model.score_func!r}",
            f"use one of {', '.join(SCORE_FUNCS)}",
        )
    for key in ("expert_hidden_dim", "n_shared_experts", "n_dense_layers"):
        if getattr(model, key) < 0:
            fail(f"model.{key}", "must be >= 0", f"set model.{key} to 0 or more")
    if model.n_dense_layers >= model.n_layers:
        fail(
            "model.n_dense_layers",
            f"n_dense_layers={model.n_dense_layers} leaves no MoE layer of "
            f"n_layers={model.n_layers}",
            f"set it below {model.n_layers}, or model.n_experts = 0 for a dense model",
        )
    for key in ("aux_loss_coeff", "bias_update_rate"):
        if getattr(model, key) < 0:
            fail(f"model.{key}", "must be >= 0", f"set model.{key} to 0 (off) or more")
    kinds = set(parse_block_pattern(model.block_pattern, model.n_layers))
    if kinds != {"standard"}:
        fail(
            "model.block_pattern",
            "MoE layers are built into standard blocks only",
            'drop model.block_pattern (all "standard") for an MoE model',
        )
    # What the built-in trainer does not build for MoE yet, refused rather than run wrong.
    if par.sequence_parallel:
        fail(
            "parallelism.sequence_parallel",
            "sequence parallel with an MoE model is not built yet (the MoE layers take the "
            "whole sequence on every TP rank)",
            "set sequence_parallel = false (TP of the attention runs without it)",
        )
    if par.cp > 1 and model.aux_loss_coeff:
        # Routing is per token, so CP splits it freely; the balance loss is per sequence, and
        # CP's ranks each hold a piece of every sequence.
        fail(
            "model.aux_loss_coeff",
            f"the sequence-wise balance loss needs whole sequences, and cp={par.cp} splits "
            "them over ranks",
            "set model.aux_loss_coeff = 0 with cp (the expert-bias update, "
            "model.bias_update_rate, balances without it), or cp = 1",
        )
    if par.ep == 1:
        return
    if model.n_experts % par.ep:
        fail(
            "parallelism.ep",
            f"ep={par.ep} must divide model.n_experts={model.n_experts} (each EP rank holds "
            "whole experts)",
            "choose ep among the divisors of n_experts",
        )
    borrowed = par.dp_shard * par.cp
    if borrowed % par.ep:
        fail(
            "parallelism.ep",
            f"ep={par.ep} must divide dp_shard*cp={borrowed}: EP borrows its ranks from "
            "dp_shard x cp, it adds none",
            "choose ep among the divisors of dp_shard*cp, or raise parallelism.dp_shard",
        )
    if par.dp_replicate > 1:
        fail(
            "parallelism.ep",
            "ep with dp_replicate > 1 (HSDP of the experts) is not built yet",
            "use dp_shard (FSDP) with ep, and dp_replicate = 1",
        )

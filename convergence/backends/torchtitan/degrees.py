"""The job's parallel degrees against torchtitan's model arguments (attention heads, layers,
sequence length), checked at collection instead of as a rank's traceback."""

from __future__ import annotations

from typing import Any

from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pp_schedules import MULTI_STAGE_SCHEDULES


def check_degrees(job: JobSpec, cfg: Any) -> None:
    """The parallel degrees against torchtitan's model arguments (attention heads, layers,
    sequence length), at collection instead of as a rank's traceback."""
    model = cfg.model_spec.model
    layout, file = job.layout, job.source
    attention = getattr(model, "first_attention", None)
    heads: int | None = getattr(attention, "n_heads", None)
    kv_heads: int | None = getattr(attention, "n_kv_heads", None) or heads
    if layout.tp > 1 and heads is not None and kv_heads is not None:
        for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
            if count % layout.tp:
                raise SpecError(
                    f"tp = {layout.tp} does not divide the model's {count} {what}",
                    file=file,
                    key="parallelism.tp",
                    fix=f"use a tp degree that divides {count}",
                )
    seq_len = int(cfg.training.seq_len)
    divisor = (layout.tp if cfg.parallelism.enable_sequence_parallel else 1) * (
        2 * layout.cp if layout.cp > 1 else 1
    )
    if seq_len % divisor:
        raise SpecError(
            f"training.seq_len {seq_len} is not a multiple of {divisor} (tp with "
            "sequence parallel x 2 x cp: torchtitan's load balancing)",
            file=file,
            key="overrides.training.seq_len",
            fix=f"use a seq_len divisible by {divisor}",
        )
    block = getattr(getattr(attention, "inner_attention", None), "block_size", None)
    if layout.cp > 1 and block is not None:  # flex attention: its CP block mask
        block = max(block) if isinstance(block, tuple) else int(block)
        if seq_len % (layout.cp * block):
            raise SpecError(
                f"training.seq_len {seq_len} is not a multiple of cp x the flex "
                f"attention block size ({layout.cp} x {block}): torch shards the "
                "block mask in whole blocks per CP rank",
                file=file,
                key="overrides.training.seq_len",
                fix=f"use a seq_len divisible by {layout.cp * block}",
            )
    layers = getattr(model, "layers", None)
    stages = layout.pp * (2 if layout.pp_schedule in MULTI_STAGE_SCHEDULES else 1)
    if layout.pp > 1 and layers is not None and len(layers) < stages:
        raise SpecError(
            f"{stages} pipeline stages for a model of {len(layers)} layers",
            file=file,
            key="parallelism.pp",
            fix="use fewer pipeline stages than the model has layers",
        )
    check_experts(job, model)


def moe_expert_counts(model: Any) -> list[int]:
    """The routed experts of each MoE layer of torchtitan's model config (DeepSeek-V3, Qwen3,
    gpt-oss, Kimi: a layer's ``moe.num_experts``); empty for a dense model."""
    layers = getattr(model, "layers", None) or []
    counts = []
    for layer in layers:
        moe = getattr(layer, "moe", None)
        experts = getattr(moe, "num_experts", None)
        if experts:
            counts.append(int(experts))
    return counts


def check_experts(job: JobSpec, model: Any) -> None:
    """``parallelism.ep`` (torchtitan's ``expert_parallel_degree``) against the model's MoE
    layers: a dense model has no experts to shard, and every layer's experts must split into
    ep whole groups."""
    ep = job.layout.ep
    if ep == 1:
        return
    counts = moe_expert_counts(model)
    if not counts:
        raise SpecError(
            f"parallelism.ep = {ep} on a dense torchtitan model (no MoE layer): expert "
            "parallelism shards the routed experts",
            file=job.source,
            key="parallelism.ep",
            fix="drop ep, or use an MoE model (e.g. backend_options = { module = "
            '"deepseek_v3", config = "deepseek_v3_debugmodel" })',
        )
    uneven = sorted({n for n in counts if n % ep})
    if uneven:
        raise SpecError(
            f"ep = {ep} does not divide the model's {uneven[0]} experts per MoE layer",
            file=job.source,
            key="parallelism.ep",
            fix=f"use an ep that divides {uneven[0]}",
        )

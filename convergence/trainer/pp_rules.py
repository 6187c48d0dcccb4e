"""The pipeline-parallel (PP) rules of the built-in trainer, in one place.

Which schedules exist, how many stages each PP rank holds, which stages those are, how many
microbatches a local batch is cut into, and which schedule/layout combinations the trainer
supports. Plain Python (no torch): `validate.check_config` applies `layout_problem` at
collection time, `pipeline` and `train` use the same functions at run time, so a combination
that would fail when the schedule is built is refused before any job is launched.

    loop style  (GPipe, 1F1B: 1 stage/rank; Interleaved1F1B, LoopedBFS,
                 InterleavedZeroBubble: >= 2 stages/rank)   rank r: r, r+pp, r+2pp, ...
    V style     (ZBVZeroBubble, DualPipeV: exactly 2/rank)  rank r: r and 2pp-1-r

so with V schedules the LAST stage (2pp-1) lives on PP rank 0, which then holds the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

# The schedule table lives in the spec (the bottom layer), which validates TOML layouts with it;
# the trainer reads it from here (pp_rules.SCHEDULES, ...).
from convergence.spec.pp_schedules import (
    AT_LEAST_ONE_MICROBATCH_PER_STAGE,
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    microbatches,
    stages_per_rank,
)

__all__ = [
    "AT_LEAST_ONE_MICROBATCH_PER_STAGE",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "Problem",
    "holds_last_stage",
    "layout_problem",
    "microbatches",
    "schedule_problem",
    "stage_ids",
    "stages_per_rank",
    "stages_problem",
]


@dataclass(frozen=True)
class Problem:
    """An unsupported PP setting: the config key to change, what is wrong, how to fix it."""

    key: str
    message: str
    fix: str


def stage_ids(pp_rank: int, pp: int, stages: int, schedule: str) -> list[int]:
    """Stage indices held by PP rank `pp_rank`, in the order the schedule expects."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages)]


def holds_last_stage(pp_rank: int, pp: int, stages: int, schedule: str) -> bool:
    """Whether this PP rank holds the last stage, i.e. computes (and logs) the loss."""
    return pp * stages - 1 in stage_ids(pp_rank, pp, stages, schedule)


def schedule_problem(schedule: str) -> Problem | None:
    if schedule not in SCHEDULES:
        return Problem(
            "parallelism.pp_schedule",
            f"unknown schedule {schedule!r}",
            f"use one of {', '.join(SCHEDULES)}",
        )
    return None


def stages_problem(schedule: str, stages: int) -> Problem | None:
    """Whether `schedule` can run `stages` (resolved) stages per rank."""
    key = "parallelism.pp_stages_per_rank"
    if schedule in MULTI_STAGE_SCHEDULES and stages < 2:
        return Problem(
            key,
            f"{schedule} needs >= 2 stages per rank, got {stages}",
            "set pp_stages_per_rank = 2 (or 0 for the default)",
        )
    if schedule in V_SCHEDULES and stages != 2:
        return Problem(
            key,
            f"{schedule} (V-shaped) holds exactly 2 stages per rank, got {stages}",
            "set pp_stages_per_rank = 2 (or 0)",
        )
    if schedule in SINGLE_STAGE_SCHEDULES and stages != 1:
        return Problem(
            key,
            f"{schedule} runs one stage per rank, got {stages}",
            "set pp_stages_per_rank = 1 (or 0), or use Interleaved1F1B",
        )
    return None


def layout_problem(
    *,
    schedule: str,
    pp: int,
    stages_configured: int | None,
    microbatches_configured: int | None,
    n_layers: int,
    local_batch_size: int,
    data_parallel: int,
) -> Problem | None:
    """The first PP rule this layout breaks, or None. `data_parallel`: dp_replicate x
    dp_shard x cp, the degree the gradients are reduced over."""
    problem = schedule_problem(schedule)
    if problem is not None or pp == 1:
        return problem
    if schedule in ZERO_BUBBLE_SCHEDULES and data_parallel > 1:
        # Measured with this trainer on torch 2.13 (gloo, debug config, step 1, same global
        # batch as the fsdp dp_shard=2 control, grad norm 0.323): InterleavedZeroBubble with
        # dp_shard=2 gave 0.041 (FSDP per chunk) and with dp_replicate=2 gave 0.415 -- the
        # gradient reduction does not see the deferred weight-grad pass. pp alone is exact.
        return Problem(
            "parallelism.pp_schedule",
            f"{schedule} defers the weight gradients to a second backward pass, which the "
            "built-in trainer's data-parallel gradient reduction (FSDP/DDP over dp_replicate "
            f"x dp_shard x cp = {data_parallel}) misses: the gradients would be wrong",
            "use GPipe, 1F1B or Interleaved1F1B with data or context parallelism, or run "
            f"{schedule} with pp only",
        )
    stages = stages_per_rank(schedule, stages_configured, pp)
    problem = stages_problem(schedule, stages)
    if problem is not None:
        return problem
    num_stages = pp * stages
    if n_layers % num_stages:
        return Problem(
            "parallelism.pp",
            f"pp * stages_per_rank = {num_stages} must divide model.n_layers={n_layers}",
            "choose pp and pp_stages_per_rank so each stage gets the same number of layers",
        )
    micro = microbatches(pp, stages, microbatches_configured)
    if local_batch_size % micro:
        return Problem(
            "parallelism.pp_microbatches",
            f"{micro} microbatches must divide training.local_batch_size={local_batch_size}",
            "choose pp_microbatches among the divisors of local_batch_size",
        )
    if schedule in MULTI_STAGE_SCHEDULES and micro % pp:
        # torch's interleaved schedules cut the microbatches into rounds of pp.
        return Problem(
            "parallelism.pp_microbatches",
            f"{schedule} needs microbatches ({micro}) divisible by pp={pp}",
            "choose a multiple of pp",
        )
    if schedule in AT_LEAST_ONE_MICROBATCH_PER_STAGE and micro < num_stages:
        return Problem(
            "parallelism.pp_microbatches",
            f"{schedule} needs at least one "
            f"microbatch per pipeline stage: {micro} microbatches < {num_stages} "
            "stages",
            f"set pp_microbatches >= {num_stages} (or 0 for the default)",
        )
    return None

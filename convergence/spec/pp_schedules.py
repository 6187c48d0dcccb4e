"""The pipeline schedules and what kind each is: the one table the experiment spec (which names
a layout may use, how many stages per rank by default) and the built-in trainer's PP rules
(convergence/trainer/pp_rules.py) both read.

Here, in the bottom layer, so the spec can import it without importing the trainer. Plain data;
tests/test_trainer_pp_cp_units.py holds the sets to what torch's schedule classes are.
"""

from __future__ import annotations

from typing import Literal, get_args

PPSchedule = Literal[
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
"""A schedule name accepted by parallelism.pp_schedule (torch's own names)."""

SCHEDULES: tuple[PPSchedule, ...] = get_args(PPSchedule)
"""Schedule names accepted by parallelism.pp_schedule, in the order messages list them."""

SINGLE_STAGE_SCHEDULES: frozenset[str] = frozenset({"GPipe", "1F1B"})
"""torch's PipelineScheduleSingle: exactly one stage per rank."""

MULTI_STAGE_SCHEDULES: frozenset[str] = frozenset(SCHEDULES) - SINGLE_STAGE_SCHEDULES
"""torch's PipelineScheduleMulti: several stages per rank (interleaved, looped, V)."""

V_SCHEDULES: frozenset[str] = frozenset({"ZBVZeroBubble", "DualPipeV"})
"""Schedules whose rank r holds stages r and 2pp-1-r (exactly 2 per rank)."""

ZERO_BUBBLE_SCHEDULES: frozenset[str] = frozenset(
    {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
)
"""Schedules that split backward into input-grad and weight-grad passes (see
pipeline.fsdp_per_block_ok and the data-parallel rule in layout_problem)."""

TORCH_FLOORS: dict[str, str] = {"DualPipeV": "2.9"}
"""The oldest torch with each schedule that not every torch this project admits has
(``ScheduleDualPipeV``: in torch 2.9's source, not in 2.8's); on an older torch its pairs are
skipped with the reason."""

AT_LEAST_ONE_MICROBATCH_PER_STAGE: frozenset[str] = frozenset({"1F1B", "DualPipeV"})
"""Schedules whose torch constructor refuses fewer microbatches than pipeline stages."""


def stages_per_rank(schedule: str, configured: int | None, pp: int = 2) -> int:
    """parallelism.pp_stages_per_rank resolved: unset (None, or 0 as the trainer's files
    spell it) means 2 for multi-stage schedules, else 1 (and 1 without PP, whatever the
    schedule). Not checked: see pp_rules.stages_problem."""
    if configured:
        return configured
    return 2 if pp > 1 and schedule in MULTI_STAGE_SCHEDULES else 1


def microbatches(pp: int, stages: int, configured: int | None) -> int:
    """parallelism.pp_microbatches resolved: unset (None, or 0) means one per stage
    (pp * stages per rank)."""
    return configured or pp * stages

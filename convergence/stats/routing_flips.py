"""Routing flips at the anchored steps of a mixture-of-experts pair.

A router's top-k is a discrete decision: where two experts' scores nearly tie, a rounding
difference in the router's input decides the tie the other way and a token goes to another
expert (a *flip*). In fp32 that is rare (none in 1800 steps of the MoE config); in bf16 it is
the rule -- one step from the same state, the forward-noise twin already moves 1-12 token
assignments (BENCHMARKS.md "MoE and expert parallelism"). A one-step gap that includes flips is
not one step of rounding but the difference of two slightly different computations, of the
size the twins' own flips give it: it is held by the one-step tolerance (k x the anchored
twins' gap, whose forward-noise twin flips too), but not by the anchored check's persistence
rule, which assumes a correct layout's gaps are isolated rounding draws well inside it. Measured:
a correct FSDP2+TP2(+EP2) in bf16 flips at its anchors as the forward-noise twin does, and its
gaps sit at 0.5-0.7 of the tolerance at anchor after anchor (persistence failed it at seed 3).

So an anchor is a *flip anchor* -- exempt from the persistence rule, never from the tolerance
itself -- where the test's one step routed tokens to other experts than the control's own step
did and at least one anchored twin's one step did too: the flips are this model's noise at this
state, not the layout's doing. A layout that moves tokens where no twin does (a dispatch or
router bug) gets no exemption, and a dense model has no routing counts, so nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import ROUTING_PREFIX

__all__ = ["flip_steps", "tokens_moved"]


def tokens_moved(control: RunMetrics, run: RunMetrics) -> dict[int, int]:
    """Per step both logged every routing count: how many token assignments ``run`` routed
    to another expert than ``control`` did (half the L1 distance of the counts, summed over
    layers: one token moved from expert a to b is 1). Empty without routing counts."""
    names = sorted(n for n in control if n.startswith(ROUTING_PREFIX))
    if not names or any(n not in run for n in names):
        return {}
    moved: dict[int, float] = {}
    logged: dict[int, int] = {}
    for name in names:
        ours = dict(zip(control[name].steps.tolist(), control[name].values.tolist(), strict=True))
        theirs = zip(run[name].steps.tolist(), run[name].values.tolist(), strict=True)
        for step, value in theirs:
            if step in ours:
                moved[step] = moved.get(step, 0.0) + abs(value - ours[step])
                logged[step] = logged.get(step, 0) + 1
    return {
        step: int(round(total / 2)) for step, total in moved.items() if logged[step] == len(names)
    }


def flip_steps(
    control: RunMetrics, anchored: RunMetrics, anchored_twins: Sequence[RunMetrics]
) -> set[int]:
    """The anchored steps at which the test's one step (``anchored``) and at least one
    anchored twin's moved tokens against the control's own step: the flip anchors (module
    docstring). Empty for a dense model or without anchored twins."""
    test = tokens_moved(control, anchored)
    if not test:
        return set()
    twins = [tokens_moved(control, twin) for twin in anchored_twins]
    return {step for step, moved in test.items() if moved and any(t.get(step, 0) for t in twins)}

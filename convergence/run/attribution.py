"""Which axis broke it: a failing N-D pair's blame, from the lower-dimensional pairs.

A pair whose test adds two or more non-DP axes (TP, its sequence parallelism, CP, PP) says
*that* it failed; a user then asks *which axis*. Some bugs live in one axis (CP's rotary offset
alone), some only in a combination (TP2+CP2 half the loss of TP4 or CP4 alone,
pytorch/torchtitan#3280). So the blame is the set of *smallest* failing sub-layouts:

1. each axis alone, on the same DP degree and tokens per step, against the same control (the
   run cache has it: it costs nothing);
2. when every axis passes alone, the combinations of two, then of three, ... -- the pairs that
   leave axes out -- until one size fails;
3. none fails below the whole layout: an interaction of all its axes.

It stops at the first size with a failure (a bug in CP alone is named by the singles: the
combinations holding CP would fail too and say nothing new). Only sub-layouts that fail name
a blame; a sub-pair that cannot run (refused by preflight, an error) is named as such and
makes the blame "undetermined" where it mattered. The pair's own verdict is never changed.

The hook (a planted bug or the user's parallelism) rides with every sub-pair: it sees the
sub-layout's mesh, as it would in a real run on that layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from itertools import combinations
from typing import TYPE_CHECKING, Any

from convergence.preflight import check_pair, validate_devices
from convergence.run.outcome import PairOutcome
from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout
from convergence.spec.pair import PairSpec

if TYPE_CHECKING:
    from convergence.launch.pool import DeviceSet

#: The non-DP axes attribution isolates, in the order they are reported. ``sp`` (sequence
#: parallelism) is TP's sub-axis: it is dropped with TP, and isolated as "TP without SP".
AXES = ("tp", "sp", "cp", "pp")
LABELS = {"tp": "TP", "sp": "SP", "cp": "CP", "pp": "PP"}


def layout_axes(layout: ParallelLayout) -> tuple[str, ...]:
    """The non-DP axes ``layout`` uses, in :data:`AXES` order."""
    used = {
        "tp": layout.tp > 1,
        "sp": layout.tp > 1 and layout.sequence_parallel,
        "cp": layout.cp > 1,
        "pp": layout.pp > 1,
    }
    return tuple(axis for axis in AXES if used[axis])


def attribution_on(*, asked: bool, tier: str) -> bool:
    """Whether a session attributes its failing N-D pairs: when asked
    (``--convergence-attribute``), and by default in the nightly tier, whose pairs are the
    multi-axis ones and whose reader is not at the keyboard to rerun them by hand."""
    return asked or tier == "nightly"


def needs_attribution(outcome: PairOutcome) -> bool:
    """A failed pair whose test has two or more non-DP axes (a 1-axis failure is its own blame;
    an error is no verdict to attribute)."""
    return outcome.status == "failed" and len(layout_axes(outcome.pair.test.layout)) >= 2


def sub_layout(layout: ParallelLayout, keep: Sequence[str]) -> ParallelLayout:
    """``layout`` with only the axes in ``keep`` (DP degrees unchanged: same tokens per step)."""
    changes: dict[str, Any] = {}
    if "tp" not in keep:
        changes.update(tp=1, sequence_parallel=False)
    elif "sp" not in keep:
        changes["sequence_parallel"] = False
    if "cp" not in keep:
        changes["cp"] = 1
    if "pp" not in keep:
        changes.update(pp=1, pp_microbatches=None, pp_stages_per_rank=None)
    return dataclasses.replace(layout, **changes)


def label(axes: Sequence[str]) -> str:
    """``"TP x CP"``; SP is written with TP (``"TP+SP"``), TP alone without SP as ``"TP"``."""
    names: list[str] = []
    for axis in axes:
        if axis == "sp":
            names[-1:] = [f"{names[-1]}+SP"] if names and names[-1] == "TP" else ["SP"]
        else:
            names.append(LABELS[axis])
    return " x ".join(names)


def sub_pair(pair: PairSpec, keep: Sequence[str]) -> PairSpec:
    """The pair with its test on the sub-layout keeping ``keep`` (named after it)."""
    layout = sub_layout(pair.test.layout, keep)
    suffix = "+".join(keep)
    return dataclasses.replace(
        pair,
        pair_id=f"{pair.pair_id}~{suffix}",
        test=dataclasses.replace(pair.test, layout=layout, name=f"{pair.test.name}~{suffix}"),
        probe_on_failure=False,  # the blame is the question here; the pair's own probe ran
        probe_always=False,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubRun:
    """One isolating pair: its axes and what it gave."""

    axes: tuple[str, ...]
    layout: str
    status: str
    """``passed``, ``failed``, ``error`` or ``not run`` (refused before it ran)."""
    first_divergent_step: int | None = None
    metric: str | None = None
    """The earliest failing metric."""
    note: str = ""
    """Why it did not run or errored; the probe's module where known."""


def attribute(
    pair: PairSpec,
    *,
    run: Callable[[PairSpec], PairOutcome],
    prepare: Callable[[PairSpec], PairSpec] = lambda p: p,
) -> dict[str, Any]:
    """The blame of a failing ``pair`` (see the module docstring), as a JSON-able record.

    ``run``: runs one pair (the Runner's ``run_pair``: the control comes from the run cache);
    ``prepare``: checks and places a sub-pair (preflight; raises SpecError when it cannot
    run here)."""
    axes = layout_axes(pair.test.layout)
    runs: list[SubRun] = []
    blamed: list[tuple[str, ...]] = []
    undetermined = False
    for size in range(1, len(axes)):
        for keep in combinations(axes, size):
            if "sp" in keep and "tp" not in keep:
                continue  # SP is a TP sub-axis: there is no SP without TP
            runs.append(_run_one(pair, keep, run=run, prepare=prepare))
            if runs[-1].status == "failed":
                blamed.append(keep)
            elif runs[-1].status != "passed":
                undetermined = True
        if blamed:
            break
    if not blamed and not undetermined:
        blamed = [axes]  # every smaller layout passed: the combination of them all
    return _record(pair, axes, runs, blamed, undetermined=undetermined and not blamed)


def _run_one(
    pair: PairSpec,
    keep: tuple[str, ...],
    *,
    run: Callable[[PairSpec], PairOutcome],
    prepare: Callable[[PairSpec], PairSpec],
) -> SubRun:
    candidate = sub_pair(pair, keep)
    layout = candidate.test.layout.short_name()
    try:
        candidate = prepare(candidate)
    except SpecError as exc:
        return SubRun(axes=keep, layout=layout, status="not run", note=exc.detail)
    outcome = run(candidate)
    step, metric = outcome.earliest_failure()
    note = (outcome.error or "")[:200] if outcome.status == "error" else ""
    if outcome.localisation and outcome.localisation.get("module"):
        note = f"first differing module {outcome.localisation['module']}"
    return SubRun(
        axes=keep,
        layout=layout,
        status=outcome.status,
        first_divergent_step=step,
        metric=metric,
        note=note,
    )


def _record(
    pair: PairSpec,
    axes: tuple[str, ...],
    runs: list[SubRun],
    blamed: list[tuple[str, ...]],
    *,
    undetermined: bool,
) -> dict[str, Any]:
    if undetermined:
        blame = "undetermined: an isolating pair could not run (see its note)"
    elif blamed == [axes]:
        blame = f"an interaction of {_and(axes)}" if len(axes) > 1 else f"{label(axes)}"
    else:
        blame = "; ".join(
            f"{label(k)} alone"
            if len(k) == 1 or k == ("tp", "sp")
            else f"an interaction of {_and(k)}"
            for k in blamed
        )
    parts = [f"{label(r.axes)}: {_said(r)}" for r in runs]
    if blamed == [axes] and not undetermined:
        parts.append(f"{label(axes)}: fail")
    return {
        "axes": [LABELS[a] for a in axes],
        "runs": [
            {
                "axes": [LABELS[a] for a in r.axes],
                "label": label(r.axes),
                "layout": r.layout,
                "status": r.status,
                "first_divergent_step": r.first_divergent_step,
                "metric": r.metric,
                "note": r.note,
            }
            for r in runs
        ],
        "blame": blame,
        "blamed": [label(k) for k in blamed],
        "summary": "; ".join(parts) + f" -> {blame}",
        "jobs": len([r for r in runs if r.status != "not run"]),
    }


def _said(run: SubRun) -> str:
    if run.status == "failed":
        where = f" at step {run.first_divergent_step}" if run.first_divergent_step else ""
        by = f" ({run.metric})" if run.metric else ""
        return f"fail{where}{by}" + (f", {run.note}" if run.note else "")
    if run.status == "passed":
        return "pass"
    return f"{run.status}" + (f" ({run.note})" if run.note else "")


def _and(axes: Sequence[str]) -> str:
    names = label(axes).split(" x ")
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def attribute_failed(
    outcome: PairOutcome,
    *,
    run: Callable[[PairSpec], PairOutcome],
    devices: DeviceSet | int | None,
    device_mode: str = "auto",
) -> PairOutcome:
    """``outcome`` with its attribution where :func:`needs_attribution` (else as it is): each
    isolating pair checked and placed like a collected one (preflight), then run with ``run``."""
    if not needs_attribution(outcome):
        return outcome

    def prepare(pair: PairSpec) -> PairSpec:
        check_pair(pair)
        return validate_devices(pair, available_devices=devices, device_mode=device_mode)

    record = attribute(outcome.pair, run=run, prepare=prepare)
    return dataclasses.replace(outcome, attribution=record)

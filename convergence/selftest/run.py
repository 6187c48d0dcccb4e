"""What the user's suite can see: the shipped bugs planted on each layout of their experiment.

For each test side of the experiment file (the user's train config, layouts, precision,
backend and machine), every bug of :data:`BUGS` that applies to the layout is planted as the
side's hook and the pair is run against the experiment's own control (from the run cache
after the first). The table says, per layout and bug, at which step and by which metric the
verdict caught it, or that it was missed -- a missed bug means this pair's length and
metrics cannot see that class of bug on this model and machine -- plus the correct layout's
worst share of its tolerance (how close the layout itself came to a false alarm).

A layout that carries its own hook is left out (planting would replace the user's code), as
is a pair that compares against a golden file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from convergence.preflight import check_pair, validate_devices
from convergence.run.outcome import PairOutcome
from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout
from convergence.spec.pair import PairSpec
from convergence.stats.band_share import band_share

HOOKS = "convergence.selftest.bugs"


@dataclass(frozen=True, kw_only=True)
class PlantedBug:
    name: str
    hook: str
    """The function in :data:`HOOKS`."""
    applies: Callable[[ParallelLayout], bool]
    note: str


BUGS: tuple[PlantedBug, ...] = (
    PlantedBug(
        name="gradient-2x",
        hook="gradient_doubled",
        applies=lambda layout: True,
        note="every gradient 2x (a sum where a mean was meant)",
    ),
    PlantedBug(
        name="dp-rank-dropped",
        hook="dp_rank_dropped",
        applies=lambda layout: layout.dp > 1,
        note="DP rank 1's gradient never arrives",
    ),
    PlantedBug(
        name="cp-rope-offset",
        hook="cp_rope_without_offset",
        applies=lambda layout: layout.cp > 1,
        note="CP shards restart rotary positions at 0",
    ),
    PlantedBug(
        name="pp-loss-summed",
        hook="pp_microbatch_loss_summed",
        applies=lambda layout: layout.pp > 1,
        note="PP microbatch losses summed, not averaged",
    ),
)


def bug_names() -> list[str]:
    return [bug.name for bug in BUGS]


def planted(pair: PairSpec, bug: PlantedBug) -> PairSpec:
    """``pair`` with ``bug`` as its test side's hook (named after both)."""
    return dataclasses.replace(
        pair,
        pair_id=f"{pair.pair_id}~{bug.name}",
        test=dataclasses.replace(
            pair.test,
            hook=f"{HOOKS}:{bug.hook}",
            hook_mode="after",
            name=f"{pair.test.name}~{bug.name}",
        ),
        probe_on_failure=False,
        probe_always=False,
        early_stop=True,  # caught is caught: the rest of the run says nothing more
    )


def worst_share(outcome: PairOutcome) -> float | None:
    """The largest share of its tolerance over the gating verdicts' bands (1 = at the edge,
    stats/band_share.py): how close a correct layout came to failing; None without a band."""
    if outcome.test is None:
        return None
    shares = [
        band_share(v.band, dict(zip(curve.steps.tolist(), curve.values.tolist(), strict=True)))
        for v in outcome.verdicts
        if v.gate and v.band is not None and (curve := outcome.test.metrics.get(v.metric))
    ]
    return max(shares) if shares else None


def selftest(
    pairs: Sequence[PairSpec],
    *,
    run: Callable[[PairSpec], PairOutcome],
    devices: Any,
    device_mode: str = "auto",
    bugs: Sequence[str] | None = None,
    layouts: Sequence[str] | None = None,
    budget: int | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (layout, bug) and one per correct layout, in run order.

    ``bugs``/``layouts``: the names to keep (None: all); ``budget``: at most this many pairs
    run (the rest are rows with status "over budget", named, not run)."""
    unknown = sorted(set(bugs or ()) - set(bug_names()))
    if unknown:
        raise SpecError(
            f"unknown selftest bug(s) {', '.join(unknown)}",
            key="--bugs",
            fix=f"use some of {', '.join(bug_names())}",
        )
    rows: list[dict[str, Any]] = []
    ran = 0

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for pair in pairs:
        if layouts is not None and pair.name not in layouts:
            continue
        base = {"pair": pair.pair_id, "layout": pair.test.layout.short_name()}
        if pair.test.hook is not None or pair.golden:
            why = "its own hook" if pair.test.hook is not None else "a golden-file control"
            add({**base, "bug": "-", "status": "left out", "note": f"the layout has {why}"})
            continue
        todo: list[tuple[str, PairSpec, str]] = [("(correct)", pair, "")]
        todo += [
            (bug.name, planted(pair, bug), bug.note)
            for bug in BUGS
            if bug.applies(pair.test.layout) and (bugs is None or bug.name in bugs)
        ]
        for name, candidate, note in todo:
            row: dict[str, Any] = {**base, "bug": name, "note": note}
            if budget is not None and ran >= budget:
                add({**row, "status": "over budget"})
                continue
            try:
                check_pair(candidate)
                candidate = validate_devices(
                    candidate, available_devices=devices, device_mode=device_mode
                )
            except SpecError as exc:
                add({**row, "status": "not run", "note": exc.detail})
                continue
            outcome = run(candidate)
            ran += 1
            step, metric = outcome.earliest_failure()
            if name == "(correct)":
                share = worst_share(outcome)
                status = {
                    "passed": "passes",
                    "failed": "FALSE ALARM",
                    "inconclusive": "inconclusive",
                }.get(outcome.status, "error")
                add({**row, "status": status, "step": step, "metric": metric, "worst_share": share})
            elif outcome.status == "failed":
                add({**row, "status": "caught", "step": step, "metric": metric})
            elif outcome.status == "passed":
                add({**row, "status": "MISSED"})
            elif outcome.status == "inconclusive":  # not caught, not passed either
                add({**row, "status": "inconclusive", "step": step, "metric": metric})
            else:
                error = (outcome.error or "").strip().splitlines()
                add({**row, "status": "not planted", "note": (error[-1] if error else "")[:160]})
    return rows


def render_table(rows: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The power table, as aligned text or markdown."""
    header = ["layout", "bug", "result", "step", "metric", "worst share", "note"]
    body = [
        [
            str(r["layout"]),
            str(r["bug"]),
            str(r["status"]),
            "" if r.get("step") is None else str(r["step"]),
            str(r.get("metric") or ""),
            "" if r.get("worst_share") is None else f"{r['worst_share']:.2f}",
            str(r.get("note") or ""),
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in body]
        return "\n".join(lines) + "\n"
    widths = [
        max(len(h), *(len(row[i]) for row in body)) if body else len(h)
        for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("-" * len(lines[0]))
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in body
    ]
    return "\n".join(lines) + "\n"

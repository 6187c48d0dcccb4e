"""One report record per pair: the plain-data view every report format is rendered from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np

from convergence.report.data.curves import (
    divergence_table,
    max_abs_delta,
    ratio,
    replicate_band,
    side_stat,
)
from convergence.report.data.jsonable import jsonable
from convergence.report.data.resume import ResumeRecord, resume_record
from convergence.report.data.serialize import metrics_to_json
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.spec.job import JobSpec
from convergence.spec.layout import DEGREES
from convergence.stats.regression import WARMUP_STEPS
from convergence.stats.types import MetricVerdict

# -- the record shapes --------------------------------------------------------------------
# What report.json holds per pair, as the sections and formats read it: TypedDicts (plain
# dicts at run time, so report.json is unchanged) that let mypy check every reader.

JsonFloat = float | str
"""A number as report.json holds it: non-finite values are "NaN", "Infinity", "-Infinity"
(jsonable); read with fmt.as_float."""
#: A technique's value: a dtype name, a flag, a count (Techniques.to_dict).
TechniqueValue = str | bool | int | float | None


class LayoutRecord(TypedDict):
    name: str
    short_name: str
    world_size: int
    degrees: dict[str, int]
    pp_schedule: str | None
    sequence_parallel: bool
    techniques: dict[str, TechniqueValue]
    hook: str | None
    steps: int
    seed: int
    backend: str


class RunFacts(TypedDict, total=False):
    """From the run's run_meta.json; empty when the side did not run."""

    num_params: int | None
    block_pattern: str | None
    collectives: dict[str, object] | None
    """Counts of collectives: forward, backward, total, by_op (a dict per op)."""
    final_val_loss: JsonFloat | None


class SideRecord(LayoutRecord):
    ran: bool
    cached: bool
    wall_s: JsonFloat | None
    status: str | None
    run_dir: str | None
    last_step: int | None
    num_replicates: int
    run_facts: RunFacts


class VerdictRecord(TypedDict):
    metric: str
    method: str
    passed: bool
    gate: bool
    steps_compared: int
    first_divergent_step: int | None
    max_deviation: JsonFloat
    max_deviation_step: int | None
    tolerance: str
    tolerance_at_max: JsonFloat | None
    p_values: dict[str, JsonFloat]
    message: str
    not_compared: bool
    """A gating metric a run did not log (the message says how to fix it); absent in
    reports written before it existed."""
    inconclusive: bool
    """Neither passed nor shown worse (the margin comparison); absent in older reports."""
    evidence: dict[str, JsonFloat | int | None] | None
    """The margin comparison's power statement: ``excludable`` (the smallest difference the
    test can exclude), ``margin``, ``num_pairs``, ``replicates_needed`` and ``more_steps``
    (what would decide an inconclusive verdict); None for other methods."""


class ResourceRecord(TypedDict):
    control: JsonFloat | None
    test: JsonFloat | None
    ratio: JsonFloat | None


class DivergenceRecord(TypedDict):
    step: int
    control: JsonFloat | None
    test: JsonFloat | None
    delta: JsonFloat | None


class WallRecord(TypedDict):
    pair: JsonFloat
    control: JsonFloat | None
    test: JsonFloat | None


class CachedRecord(TypedDict):
    control: bool
    test: bool


class CurveRecord(TypedDict):
    metric: str
    steps: list[int]
    values: list[JsonFloat]


class CurvesRecord(TypedDict):
    control: dict[str, CurveRecord]
    test: dict[str, CurveRecord]
    control_replicates: list[dict[str, CurveRecord]]


Localisation = dict[str, Any]
"""The numerics probe's result (run.probe / run.probe_compare): keys vary with what it found."""


class PairRecord(TypedDict):
    """Everything the reports show about one pair (report.json's ``pairs`` items)."""

    id: str
    name: str
    source: str
    status: str
    regime: str
    tier: str
    placement: NotRequired[str]
    control: SideRecord
    test: SideRecord
    techniques_changed: dict[str, TechniqueValue]
    verdicts: list[VerdictRecord]
    first_divergent_step: int | None
    max_abs_delta: dict[str, JsonFloat | None]
    delta_reference: str
    resources: dict[str, ResourceRecord]
    wall_s: WallRecord
    cached: CachedRecord
    stopped_early_at: int | None
    error: str | None
    localisation: Localisation | None
    divergence: dict[str, list[DivergenceRecord]]
    plots: dict[str, str]
    plot_error: str | None
    curves: NotRequired[CurvesRecord]
    resume: NotRequired[ResumeRecord]
    """Only for a resuming test side (report/data/resume.py)."""
    attribution: NotRequired[dict[str, Any]]
    """Only for a failed N-D pair that was attributed (run/attribution.py)."""


def not_compared(pairs: Sequence[PairRecord]) -> list[tuple[PairRecord, VerdictRecord]]:
    """Every pair's verdicts that were not compared (a run did not log the metric), passed
    pairs too: what the reports' not-compared section lists."""
    return [(p, v) for p in pairs for v in p["verdicts"] if v.get("not_compared")]


#: Resource metrics compared test vs control: (metric, summary used per run).
RESOURCES: tuple[tuple[str, str], ...] = (("tokens_per_s", "median"), ("peak_mem_mib", "max"))
DELTA_METRICS: tuple[str, ...] = ("loss", "grad_norm")
DIVERGENCE_AROUND = 3


def techniques_changed(outcome: PairOutcome) -> dict[str, TechniqueValue]:
    """Techniques of the test that differ from the control, plus the hook when one is set."""
    test, control = outcome.pair.test, outcome.pair.control
    changed: dict[str, TechniqueValue] = test.techniques.changed_from(control.techniques)
    if test.hook and test.hook != control.hook:
        changed["hook"] = test.hook
    return changed


def layout_record(job: JobSpec) -> LayoutRecord:
    layout = job.layout
    return {
        "name": job.name,
        "short_name": layout.short_name(),
        "world_size": layout.world_size,
        "degrees": {axis: layout.degrees()[axis] for axis in DEGREES},
        "pp_schedule": layout.pp_schedule if layout.pp > 1 else None,
        "sequence_parallel": layout.sequence_parallel,
        "techniques": job.techniques.to_dict(),
        "hook": job.hook,
        "steps": job.steps,
        "seed": job.seed,
        "backend": job.backend,
    }


def side_record(job: JobSpec, side: SideOutcome | None) -> SideRecord:
    """The layout always (it comes from the spec); run facts only when the side ran."""
    ran = side is not None
    return {
        **layout_record(job),
        "ran": ran,
        "cached": bool(side and side.cached),
        "wall_s": side.wall_s if side else None,
        "status": (
            side.result.status
            if side and side.result
            else ("cached" if side and side.cached else None)
        ),
        "run_dir": str(side.run_dir) if side and side.run_dir else None,
        "last_step": side.result.last_step if side and side.result else None,
        "num_replicates": len(side.replicates) if side else 0,
        "run_facts": side_facts(side),  # block pattern, collectives, params
    }


def side_facts(side: SideOutcome | None) -> RunFacts:
    """Facts of one run beyond its curves, from its run_meta.json and its validation curve:
    what the reduced-communication study shows (sections.comm_blocks)."""
    if side is None:
        return {}
    meta = side.meta
    val = side.metrics.get("val_loss")
    final_val = None
    if val is not None and len(val):
        finite = val.values[np.isfinite(val.values)]
        final_val = float(finite[-1]) if finite.size else None
    return {
        "num_params": meta.get("num_params"),
        "block_pattern": meta.get("block_pattern"),
        "collectives": meta.get("collectives"),
        "final_val_loss": final_val,
    }


def verdict_record(v: MetricVerdict) -> VerdictRecord:
    return {
        "metric": v.metric,
        "method": v.method,
        "passed": v.passed,
        "gate": v.gate,
        "steps_compared": v.steps_compared,
        "first_divergent_step": v.first_divergent_step,
        "max_deviation": v.max_deviation,
        "max_deviation_step": v.max_deviation_step,
        "tolerance": v.tolerance,
        "tolerance_at_max": v.tolerance_at_max,
        "p_values": dict(v.p_values),
        "message": v.message,
        "not_compared": v.not_compared,
        "inconclusive": v.inconclusive,
        "evidence": _evidence(v),
    }


def _evidence(v: MetricVerdict) -> dict[str, JsonFloat | int | None] | None:
    if "excludable" not in v.details:
        return None
    keys = ("excludable", "margin", "num_pairs", "replicates_needed", "more_steps")
    return {k: v.details.get(k) for k in keys}


def first_divergent_step(outcome: PairOutcome) -> int | None:
    """Earliest first-divergent step over the failing gate verdicts."""
    steps = [
        v.first_divergent_step
        for v in outcome.verdicts
        if v.gate and not v.passed and v.first_divergent_step is not None
    ]
    return min(steps) if steps else None


def step_time_s(side: SideOutcome | None) -> float | None:
    """Median seconds per optimizer step: the run's tokens per step (its run_meta) / tokens/s
    of each step, the warm-up steps left out as in :func:`side_stat`. None without the meta."""
    tokens = side.meta.get("tokens_per_step") if side is not None else None
    if (
        side is None
        or not isinstance(tokens, (int, float))
        or tokens <= 0
        or "tokens_per_s" not in side.metrics
    ):
        return None
    values = side.metrics["tokens_per_s"].values
    values = values[WARMUP_STEPS:] if values.size > WARMUP_STEPS else values
    values = values[np.isfinite(values) & (values > 0)]
    if values.size == 0:
        return None
    return float(np.median(float(tokens) / values))


def resources(outcome: PairOutcome) -> dict[str, ResourceRecord]:
    out: dict[str, ResourceRecord] = {}
    for metric, how in RESOURCES:
        ctrl, test = side_stat(outcome.control, metric, how), side_stat(outcome.test, metric, how)
        out[metric] = {"control": ctrl, "test": test, "ratio": ratio(test, ctrl)}
    ctrl, test = step_time_s(outcome.control), step_time_s(outcome.test)
    out["step_time_s"] = {"control": ctrl, "test": test, "ratio": ratio(test, ctrl)}
    return out


def curves_record(outcome: PairOutcome) -> CurvesRecord:
    control, test = outcome.control, outcome.test
    return {
        "control": metrics_to_json(control.metrics) if control else {},
        "test": metrics_to_json(test.metrics) if test else {},
        "control_replicates": [metrics_to_json(r) for r in control.replicates] if control else [],
    }


def _divergence(outcome: PairOutcome) -> dict[str, list[DivergenceRecord]]:
    out: dict[str, list[DivergenceRecord]] = {}
    for v in outcome.verdicts:
        if v.passed or v.metric in ("tokens_per_s", "peak_mem_mib"):
            continue
        rows = divergence_table(outcome, v.metric, DIVERGENCE_AROUND)
        if rows:
            out[v.metric] = [
                {"step": s, "control": c, "test": t, "delta": d} for s, c, t, d in rows
            ]
    return out


def pair_record(
    outcome: PairOutcome,
    *,
    plots: Mapping[str, str] | None = None,
    plot_error: str | None = None,
    include_curves: bool = True,
) -> PairRecord:
    """Everything the reports show about one pair (JSON-ready, non-finite floats encoded)."""
    pair = outcome.pair
    control, test = outcome.control, outcome.test
    band = any(replicate_band(outcome, m) is not None for m in DELTA_METRICS)
    record: PairRecord = {
        "id": pair.pair_id,
        "name": pair.name,
        "source": pair.source,
        "status": outcome.status,
        "regime": pair.regime,
        "tier": pair.tier,
        "placement": pair.placement,
        "control": side_record(pair.control, control),
        "test": side_record(pair.test, test),
        "techniques_changed": techniques_changed(outcome),
        "verdicts": [verdict_record(v) for v in outcome.verdicts],
        "first_divergent_step": first_divergent_step(outcome),
        "max_abs_delta": {m: max_abs_delta(outcome, m) for m in DELTA_METRICS},
        "delta_reference": "control band centre" if band else "control",
        "resources": resources(outcome),
        "wall_s": {
            "pair": outcome.wall_s,
            "control": control.wall_s if control else None,
            "test": test.wall_s if test else None,
        },
        "cached": {"control": bool(control and control.cached), "test": bool(test and test.cached)},
        "stopped_early_at": outcome.stopped_early_at,
        "error": outcome.error,
        "localisation": outcome.localisation,
        "divergence": _divergence(outcome),
        "plots": dict(plots or {}),
        "plot_error": plot_error,
    }
    if outcome.attribution is not None:
        record["attribution"] = outcome.attribution
    resume = resume_record(outcome, record["first_divergent_step"])
    if resume is not None:
        record["resume"] = resume
    if include_curves:
        record["curves"] = curves_record(outcome)
    encoded: PairRecord = jsonable(record)  # same shape, non-finite floats as strings
    return encoded


def relative_plot(path: Path, report_dir: Path | None) -> str:
    """A plot path as the report refers to it: relative to the report folder when inside it."""
    if report_dir is not None:
        try:
            return path.resolve().relative_to(report_dir.resolve()).as_posix()
        except ValueError:
            pass
    return str(path)

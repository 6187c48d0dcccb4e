"""One report record per pair: the plain-data view every report format is rendered from."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convergence.report.data.curves import (
    divergence_table,
    max_abs_delta,
    ratio,
    replicate_band,
    side_stat,
)
from convergence.report.data.jsonable import jsonable
from convergence.report.data.serialize import metrics_to_json
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.spec.job import JobSpec
from convergence.spec.layout import AXES
from convergence.stats.types import MetricVerdict

#: Resource metrics compared test vs control: (metric, summary used per run).
RESOURCES: tuple[tuple[str, str], ...] = (("tokens_per_s", "median"), ("peak_mem_mib", "max"))
DELTA_METRICS: tuple[str, ...] = ("loss", "grad_norm")
DIVERGENCE_AROUND = 3


def techniques_changed(outcome: PairOutcome) -> dict[str, Any]:
    """Techniques of the test that differ from the control, plus the hook when one is set."""
    test, control = outcome.pair.test, outcome.pair.control
    changed = test.techniques.changed_from(control.techniques)
    if test.hook and test.hook != control.hook:
        changed["hook"] = test.hook
    return changed


def layout_record(job: JobSpec) -> dict[str, Any]:
    layout = job.layout
    return {
        "name": job.name, "short_name": layout.short_name(), "world_size": layout.world_size,
        "degrees": {axis: layout.degrees()[axis] for axis in AXES},
        "pp_schedule": layout.pp_schedule if layout.pp > 1 else None,
        "sequence_parallel": layout.sequence_parallel,
        "techniques": job.techniques.to_dict(), "hook": job.hook, "steps": job.steps,
        "seed": job.seed, "backend": job.backend,
    }


def side_record(job: JobSpec, side: SideOutcome | None) -> dict[str, Any]:
    """The layout always (it comes from the spec); run facts only when the side ran."""
    record = layout_record(job)
    ran = side is not None
    record.update({
        "ran": ran,
        "cached": bool(side and side.cached),
        "wall_s": side.wall_s if side else None,
        "status": (side.result.status if side and side.result else
                   ("cached" if side and side.cached else None)),
        "run_dir": str(side.run_dir) if side and side.run_dir else None,
        "last_step": side.result.last_step if side and side.result else None,
        "num_replicates": len(side.replicates) if side else 0,
    })
    record["run_facts"] = side_facts(side)  # block pattern, collectives, params
    return record


def side_facts(side: SideOutcome | None) -> dict[str, Any]:
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
    return {"num_params": meta.get("num_params"), "block_pattern": meta.get("block_pattern"),
            "collectives": meta.get("collectives"), "final_val_loss": final_val}


def verdict_record(v: MetricVerdict) -> dict[str, Any]:
    return {
        "metric": v.metric, "method": v.method, "passed": v.passed, "gate": v.gate,
        "steps_compared": v.steps_compared, "first_divergent_step": v.first_divergent_step,
        "max_deviation": v.max_deviation, "max_deviation_step": v.max_deviation_step,
        "tolerance": v.tolerance, "tolerance_at_max": v.tolerance_at_max,
        "p_values": dict(v.p_values), "message": v.message,
    }


def first_divergent_step(outcome: PairOutcome) -> int | None:
    """Earliest first-divergent step over the failing gate verdicts."""
    steps = [v.first_divergent_step for v in outcome.verdicts
             if v.gate and not v.passed and v.first_divergent_step is not None]
    return min(steps) if steps else None


def step_time_s(side: SideOutcome | None) -> float | None:
    """Median seconds per optimizer step: the run's tokens per step (its run_meta) / tokens/s
    of each step, the first step left out as in :func:`side_stat`. None without the meta."""
    tokens = side.meta.get("tokens_per_step") if side is not None else None
    if side is None or not isinstance(tokens, (int, float)) or tokens <= 0 \
            or "tokens_per_s" not in side.metrics:
        return None
    values = side.metrics["tokens_per_s"].values
    values = values[np.isfinite(values) & (values > 0)]
    if values.size == 0:
        return None
    return float(np.median(float(tokens) / (values[1:] if values.size > 1 else values)))


def resources(outcome: PairOutcome) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric, how in RESOURCES:
        ctrl, test = side_stat(outcome.control, metric, how), side_stat(outcome.test, metric, how)
        out[metric] = {"control": ctrl, "test": test, "ratio": ratio(test, ctrl)}
    ctrl, test = step_time_s(outcome.control), step_time_s(outcome.test)
    out["step_time_s"] = {"control": ctrl, "test": test, "ratio": ratio(test, ctrl)}
    return out


def curves_record(outcome: PairOutcome) -> dict[str, Any]:
    control, test = outcome.control, outcome.test
    return {
        "control": metrics_to_json(control.metrics) if control else {},
        "test": metrics_to_json(test.metrics) if test else {},
        "control_replicates": [metrics_to_json(r) for r in control.replicates] if control
        else [],
    }


def _divergence(outcome: PairOutcome) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for v in outcome.verdicts:
        if v.passed or v.metric in ("tokens_per_s", "peak_mem_mib"):
            continue
        rows = divergence_table(outcome, v.metric, DIVERGENCE_AROUND)
        if rows:
            out[v.metric] = [{"step": s, "control": c, "test": t, "delta": d}
                             for s, c, t, d in rows]
    return out


def pair_record(outcome: PairOutcome, *, plots: Mapping[str, str] | None = None,
                plot_error: str | None = None, include_curves: bool = True) -> dict[str, Any]:
    """Everything the reports show about one pair (JSON-ready, non-finite floats encoded)."""
    pair = outcome.pair
    control, test = outcome.control, outcome.test
    band = any(replicate_band(outcome, m) is not None for m in DELTA_METRICS)
    record: dict[str, Any] = {
        "id": pair.pair_id, "name": pair.name, "source": pair.source, "status": outcome.status,
        "regime": pair.regime, "tier": pair.tier,
        "control": side_record(pair.control, control),
        "test": side_record(pair.test, test),
        "techniques_changed": techniques_changed(outcome),
        "verdicts": [verdict_record(v) for v in outcome.verdicts],
        "first_divergent_step": first_divergent_step(outcome),
        "max_abs_delta": {m: max_abs_delta(outcome, m) for m in DELTA_METRICS},
        "delta_reference": "control band centre" if band else "control",
        "resources": resources(outcome),
        "wall_s": {"pair": outcome.wall_s, "control": control.wall_s if control else None,
                   "test": test.wall_s if test else None},
        "cached": {"control": bool(control and control.cached),
                   "test": bool(test and test.cached)},
        "stopped_early_at": outcome.stopped_early_at,
        "error": outcome.error,
        "localisation": outcome.localisation,
        "divergence": _divergence(outcome),
        "plots": dict(plots or {}),
        "plot_error": plot_error,
    }
    if include_curves:
        record["curves"] = curves_record(outcome)
    return jsonable(record)  # type: ignore[no-any-return]


def relative_plot(path: Path, report_dir: Path | None) -> str:
    """A plot path as the report refers to it: relative to the report folder when inside it."""
    if report_dir is not None:
        try:
            return path.resolve().relative_to(report_dir.resolve()).as_posix()
        except ValueError:
            pass
    return str(path)

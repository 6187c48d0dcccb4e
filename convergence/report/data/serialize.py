"""PairOutcome <-> JSON, so reports can be rebuilt later from saved outcomes.

Curves are saved in full at float64 precision (``repr`` round-trips exactly); non-finite values
are written as strings (see :mod:`convergence.report.data.jsonable`) so the files are strict JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from convergence.launch.types import FailureInfo, JobResult
from convergence.metrics.curve import Curve, RunMetrics
from convergence.report.data.jsonable import jsonable, read_float, read_opt_float
from convergence.run.outcome import PairOutcome, SideOutcome
from convergence.spec.experiment import frozen_value
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.pair import ComparisonRule, PairSpec
from convergence.spec.resume import Resume
from convergence.stats.types import Band, MetricVerdict

OUTCOME_FORMAT = "convergence.outcome/1"
"""Written into every outcome; bump when the shape changes incompatibly."""


class OutcomeFormatError(ValueError):
    """A saved outcome cannot be read (wrong version, missing or malformed key)."""


# -- to JSON ----------------------------------------------------------------------------------
def curve_to_json(curve: Curve) -> dict[str, Any]:
    return {
        "metric": curve.metric,
        "steps": [int(s) for s in curve.steps.tolist()],
        "values": jsonable(curve.values.tolist()),
    }


def metrics_to_json(metrics: RunMetrics) -> dict[str, Any]:
    return {name: curve_to_json(curve) for name, curve in metrics.items()}


# JobSpec and PairSpec are written field by field from their dataclass definitions, so a field
# added later is saved and read back without touching this file (fields listed by hand were
# dropped silently: hook_mode, probe_always). Only fields whose JSON shape differs need a rule.
_TO_JSON: dict[str, Any] = {
    "train_config": str,
    "layout": lambda v: v.to_dict(),
    "techniques": lambda v: v.to_dict(),
    "control": lambda v: job_to_json(v),
    "test": lambda v: job_to_json(v),
    "rules": lambda v: [jsonable(asdict(r)) for r in v],
    "resume": lambda v: None if v is None else v.to_dict(),
    "check_keys": lambda v: jsonable(dict(v)),
}
_FROM_JSON: dict[str, Any] = {
    "train_config": Path,
    "layout": lambda d: ParallelLayout(**d),
    "techniques": lambda d: Techniques(**d),
    "control": lambda d: job_from_json(d),
    "test": lambda d: job_from_json(d),
    "rules": lambda v: tuple(map(_rule_from_json, v)),
    "overrides": lambda v: _pairs(v),
    "backend_options": lambda v: _pairs(v),
    "extra": lambda v: _pairs(v),
    "check_keys": lambda d: tuple((str(k), frozen_value(v)) for k, v in d.items()),
    "steps": int,
    "seed": int,
    "replicates": int,
    "resume": lambda d: (
        None
        if d is None
        else Resume(
            at_step=int(d["at_step"]),
            layout=ParallelLayout(**d["layout"]),
            techniques=Techniques(**d["techniques"]),
            local_batch_size=d.get("local_batch_size"),
        )
    ),
}


def _pairs(items: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in items)


def _spec_to_json(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name in _TO_JSON:
            out[f.name] = _TO_JSON[f.name](value)
        elif isinstance(value, tuple):
            out[f.name] = [list(v) if isinstance(v, tuple) else v for v in value]
        else:
            out[f.name] = value
    return out


def _spec_from_json(cls: Any, data: Mapping[str, Any]) -> Any:
    """Missing keys take the field's default (outcomes saved by an older version); unknown
    keys are ignored (a newer one)."""
    kwargs = {
        f.name: _FROM_JSON.get(f.name, lambda v: v)(data[f.name])
        for f in fields(cls)
        if f.name in data
    }
    return cls(**kwargs)


def job_to_json(job: JobSpec) -> dict[str, Any]:
    # The trainer request as the overrides it travelled as before it had a type (as the job's
    # key holds it: TrainerRequest.as_overrides), so a saved outcome reads as it did; it is
    # read back as overrides (a report only shows them; nothing reruns a saved job).
    data = _spec_to_json(
        dataclasses.replace(job, overrides=(*job.overrides, *job.request.as_overrides()))
    )
    data.pop("request")
    return data


def pair_to_json(pair: PairSpec) -> dict[str, Any]:
    return _spec_to_json(pair)


def result_to_json(result: JobResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    data: dict[str, Any] = jsonable(
        {
            "name": result.name,
            "status": result.status,
            "returncode": result.returncode,
            "wall_s": result.wall_s,
            "log_dir": result.log_dir,
            "metrics_path": result.metrics_path,
            "failure": None if result.failure is None else asdict(result.failure),
            "last_step": result.last_step,
        }
    )
    return data


def side_to_json(side: SideOutcome | None) -> dict[str, Any] | None:
    if side is None:
        return None
    return {
        "job": job_to_json(side.job),
        "metrics": metrics_to_json(side.metrics),
        "result": result_to_json(side.result),
        "cached": side.cached,
        "run_dir": None if side.run_dir is None else str(side.run_dir),
        "wall_s": jsonable(side.wall_s),
        "replicates": [metrics_to_json(r) for r in side.replicates],
        # The noise twin's curves only (what the report's residual plot draws).
        "twin": metrics_to_json(side.twins[0]) if side.twins else None,
        "meta": jsonable(side.meta),
    }


def verdict_to_json(verdict: MetricVerdict) -> dict[str, Any]:
    return jsonable(verdict.to_json())  # type: ignore[no-any-return]


def outcome_to_json(o: PairOutcome) -> dict[str, Any]:
    """A strict-JSON dict holding everything in ``o`` (read back by :func:`outcome_from_json`)."""
    return {
        "format": OUTCOME_FORMAT,
        "pair": pair_to_json(o.pair),
        "status": o.status,
        "control": side_to_json(o.control),
        "test": side_to_json(o.test),
        "verdicts": [verdict_to_json(v) for v in o.verdicts],
        "error": o.error,
        "stopped_early_at": o.stopped_early_at,
        "localisation": jsonable(o.localisation),
        "attribution": jsonable(o.attribution),
        "plots": [str(p) for p in o.plots],
        "wall_s": jsonable(o.wall_s),
    }


# -- from JSON --------------------------------------------------------------------------------
def curve_from_json(data: Mapping[str, Any], metric: str | None = None) -> Curve:
    values = np.asarray([read_float(v) for v in data["values"]], dtype=np.float64)
    steps = np.asarray(data["steps"], dtype=np.int64)
    return Curve(str(data.get("metric", metric)), steps, values)


def metrics_from_json(data: Mapping[str, Any]) -> RunMetrics:
    return {str(name): curve_from_json(c, name) for name, c in data.items()}


def job_from_json(data: Mapping[str, Any]) -> JobSpec:
    job: JobSpec = _spec_from_json(JobSpec, data)
    return job


def _rule_from_json(data: Mapping[str, Any]) -> ComparisonRule:
    known = {f.name for f in fields(ComparisonRule)}
    return ComparisonRule(**{k: v for k, v in data.items() if k in known})


def pair_from_json(data: Mapping[str, Any]) -> PairSpec:
    if "check_keys" not in data and data.get("anchor_auto") is False:
        # Saved before the checks owned their keys: anchor_every was a field of the pair
        # (anchor_auto False: as the experiment wrote it).
        data = {**data, "check_keys": {"anchor_every": data.get("anchor_every", 0)}}
    pair: PairSpec = _spec_from_json(PairSpec, data)
    return pair


def result_from_json(data: Mapping[str, Any] | None) -> JobResult | None:
    if data is None:
        return None
    failure = data.get("failure")
    return JobResult(
        name=data["name"],
        status=data["status"],
        returncode=data.get("returncode"),
        wall_s=read_float(data.get("wall_s", 0.0)),
        log_dir=Path(data["log_dir"]),
        metrics_path=None if data.get("metrics_path") is None else Path(data["metrics_path"]),
        failure=None if failure is None else FailureInfo(**failure),
        last_step=data.get("last_step"),
    )


def side_from_json(data: Mapping[str, Any] | None) -> SideOutcome | None:
    if data is None:
        return None
    return SideOutcome(
        job=job_from_json(data["job"]),
        metrics=metrics_from_json(data.get("metrics", {})),
        result=result_from_json(data.get("result")),
        cached=bool(data.get("cached", False)),
        run_dir=None if data.get("run_dir") is None else Path(data["run_dir"]),
        wall_s=read_float(data.get("wall_s", 0.0)),
        replicates=tuple(metrics_from_json(r) for r in data.get("replicates", [])),
        twins=() if data.get("twin") is None else (metrics_from_json(data["twin"]),),
        meta=dict(data.get("meta", {})),
    )


def verdict_from_json(data: Mapping[str, Any]) -> MetricVerdict:
    return MetricVerdict(
        metric=data["metric"],
        method=data["method"],
        passed=bool(data["passed"]),
        gate=bool(data["gate"]),
        steps_compared=int(data.get("steps_compared", 0)),
        not_compared=bool(data.get("not_compared", False)),
        inconclusive=bool(data.get("inconclusive", False)),
        first_divergent_step=data.get("first_divergent_step"),
        max_deviation=read_float(data.get("max_deviation", 0.0)),
        max_deviation_step=data.get("max_deviation_step"),
        tolerance=data.get("tolerance", ""),
        tolerance_at_max=read_opt_float(data.get("tolerance_at_max")),
        p_values={str(k): read_float(v) for k, v in data.get("p_values", {}).items()},
        message=data.get("message", ""),
        details=dict(data.get("details", {})),
        band=band_from_json(data.get("band")),
    )


def band_from_json(data: Mapping[str, Any] | None) -> Band | None:
    """A verdict's band; None for verdicts saved before verdicts carried one."""
    if data is None:
        return None
    return Band.of(
        data["steps"],
        (read_float(v) for v in data["lower"]),
        (read_float(v) for v in data["upper"]),
    )


def outcome_from_json(d: Mapping[str, Any]) -> PairOutcome:
    """Rebuild a PairOutcome saved by :func:`outcome_to_json`.

    Raises OutcomeFormatError naming the missing/invalid key when the data is not such an
    outcome (e.g. written by an incompatible version).
    """
    fmt = d.get("format") if isinstance(d, Mapping) else None
    if fmt != OUTCOME_FORMAT:
        raise OutcomeFormatError(
            f"not a saved outcome of format {OUTCOME_FORMAT!r} (found format={fmt!r}); "
            "fix: re-run the pairs with this version of pytest-convergence"
        )
    try:
        return PairOutcome(
            pair=pair_from_json(d["pair"]),
            status=d["status"],
            control=side_from_json(d.get("control")),
            test=side_from_json(d.get("test")),
            verdicts=tuple(verdict_from_json(v) for v in d.get("verdicts", [])),
            error=d.get("error"),
            stopped_early_at=d.get("stopped_early_at"),
            localisation=d.get("localisation"),
            attribution=d.get("attribution"),
            plots=tuple(Path(p) for p in d.get("plots", [])),
            wall_s=read_float(d.get("wall_s", 0.0)),
        )
    except KeyError as exc:
        raise OutcomeFormatError(
            f"saved outcome has no key {exc}; fix: re-run the pairs with "
            "this version of pytest-convergence"
        ) from None
    except (TypeError, ValueError) as exc:
        raise OutcomeFormatError(f"saved outcome is malformed: {exc}") from None

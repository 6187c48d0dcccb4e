"""report.json: its versioned JSON Schema and :func:`build_report`.

Bump :data:`REPORT_SCHEMA_VERSION` on any incompatible change (a removed or renamed key, a
changed meaning); adding optional keys keeps the version.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import socket
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

from convergence.backends import CodeIdentity, get_backend
from convergence.regimes import REGISTRY
from convergence.report.data.jsonable import NON_FINITE, jsonable
from convergence.report.data.records import JsonFloat, PairRecord, pair_record, relative_plot
from convergence.run.outcome import PAIR_STATUSES, PairOutcome
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import AXES

REPORT_SCHEMA_VERSION = 1


class ReportDocument(TypedDict):
    """report.json as the formats read it (see REPORT_JSON_SCHEMA for the same, as data)."""

    schema_version: int
    generated_at: str | None
    started_at: str | None
    wall_s: JsonFloat | None
    environment: dict[str, Any]
    """Open-ended: what default_environment found plus what the caller adds."""
    summary: dict[str, int]
    plots: dict[str, str]
    pairs: list[PairRecord]


_NUM: dict[str, Any] = {"anyOf": [{"type": "number"}, {"enum": list(NON_FINITE)}]}
_OPT_NUM: dict[str, Any] = {"anyOf": [{"type": "number"}, {"enum": [*NON_FINITE, None]}]}
_OPT_INT: dict[str, Any] = {"type": ["integer", "null"]}
_OPT_STR: dict[str, Any] = {"type": ["string", "null"]}
_INT: dict[str, Any] = {"type": "integer"}
_STR: dict[str, Any] = {"type": "string"}
_BOOL: dict[str, Any] = {"type": "boolean"}
_COUNT: dict[str, Any] = {"type": "integer", "minimum": 0}


def _object(
    required: Mapping[str, Any], optional: Mapping[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """A JSON object's schema with each key written once: ``required`` keys must be present,
    ``optional`` ones may be; ``extra``: more schema keywords (e.g. additionalProperties)."""
    return {
        "type": "object",
        "required": list(required),
        **extra,
        "properties": {**required, **(optional or {})},
    }


_CURVE = _object(
    {"steps": {"type": "array", "items": _INT}, "values": {"type": "array", "items": _NUM}},
    {"metric": _STR},
)
_RUN_CURVES: dict[str, Any] = {"type": "object", "additionalProperties": {"$ref": "#/$defs/curve"}}

_SIDE = _object(
    {
        "name": _STR,
        "short_name": _STR,
        "world_size": {"type": "integer", "minimum": 1},
        # ep optional: report.json files written before EP was a degree have none.
        "degrees": _object(
            {a: {"type": "integer", "minimum": 1} for a in AXES},
            {"ep": {"type": "integer", "minimum": 1}},
            additionalProperties=False,
        ),
        "techniques": {"type": "object"},
        "ran": _BOOL,
        "cached": _BOOL,
        "wall_s": _OPT_NUM,
        "status": _OPT_STR,
    },
    {
        "pp_schedule": _OPT_STR,
        "sequence_parallel": _BOOL,
        "hook": _OPT_STR,
        "steps": _INT,
        "seed": _INT,
        "backend": _STR,
        "run_dir": _OPT_STR,
        "last_step": _OPT_INT,
        "num_replicates": _COUNT,
    },
)

_VERDICT = _object(
    {
        "metric": _STR,
        "method": _STR,
        "passed": _BOOL,
        "gate": _BOOL,
        "first_divergent_step": _OPT_INT,
        "max_deviation": _NUM,
        "max_deviation_step": _OPT_INT,
        "tolerance": _STR,
        "p_values": {"type": "object", "additionalProperties": _NUM},
        "message": _STR,
    },
    {
        "steps_compared": _INT,
        "tolerance_at_max": _OPT_NUM,
        "not_compared": _BOOL,
        "inconclusive": _BOOL,
        "evidence": {"type": ["object", "null"]},
    },
)

_RESOURCE = _object({"control": _OPT_NUM, "test": _OPT_NUM, "ratio": _OPT_NUM})

_ATTRIBUTION_RUN = _object(
    {
        "axes": {"type": "array", "items": _STR},
        "label": _STR,
        "layout": _STR,
        "status": _STR,
        "first_divergent_step": _OPT_INT,
        "metric": _OPT_STR,
        "note": _STR,
    }
)

_DIVERGENCE_ROW = _object({"step": _INT, "control": _OPT_NUM, "test": _OPT_NUM, "delta": _OPT_NUM})

_PAIR = _object(
    {
        "id": _STR,
        "name": _STR,
        "source": _STR,
        "status": {"enum": list(PAIR_STATUSES)},
        "regime": {"enum": list(REGISTRY.names())},
        "control": {"$ref": "#/$defs/side"},
        "test": {"$ref": "#/$defs/side"},
        "techniques_changed": {"type": "object"},
        "verdicts": {"type": "array", "items": {"$ref": "#/$defs/verdict"}},
        "first_divergent_step": _OPT_INT,
        "max_abs_delta": {
            "type": "object",
            "required": ["loss", "grad_norm"],
            "additionalProperties": _OPT_NUM,
        },
        "resources": {
            "type": "object",
            "required": ["tokens_per_s", "peak_mem_mib"],
            "additionalProperties": {"$ref": "#/$defs/resource"},
        },
        "wall_s": _object({"pair": _NUM, "control": _OPT_NUM, "test": _OPT_NUM}),
        "cached": _object({"control": _BOOL, "test": _BOOL}),
        "stopped_early_at": _OPT_INT,
        "error": _OPT_STR,
        "localisation": {"type": ["object", "null"]},
        "divergence": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"$ref": "#/$defs/divergence_row"}},
        },
        "plots": {"type": "object", "additionalProperties": _STR},
    },
    {
        "tier": _STR,
        "placement": _STR,
        "delta_reference": _STR,
        "plot_error": _OPT_STR,
        "resume": _object(
            {"at_step": _INT, "before": _STR, "after": _STR, "note": _OPT_STR},
            {
                "layout": _object(
                    {
                        "degrees": {"type": "object", "additionalProperties": _INT},
                        "pp_schedule": _OPT_STR,
                        "sequence_parallel": _BOOL,
                    }
                )
            },
        ),
        "attribution": _object(
            {
                "axes": {"type": "array", "items": _STR},
                "runs": {"type": "array", "items": {"$ref": "#/$defs/attribution_run"}},
                "blame": _STR,
                "blamed": {"type": "array", "items": _STR},
                "summary": _STR,
                "jobs": _INT,
            }
        ),
        "curves": _object(
            {
                "control": _RUN_CURVES,
                "test": _RUN_CURVES,
                "control_replicates": {"type": "array", "items": _RUN_CURVES},
            }
        ),
    },
)

_SUMMARY_COUNTS = ("pairs", "passed", "failed", "errors", "skipped", "cached_runs", "fresh_runs")

REPORT_JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://pytest-convergence/report.schema.json",
    "title": "pytest-convergence report",
    **_object(
        {
            "schema_version": {"const": REPORT_SCHEMA_VERSION},
            "generated_at": _STR,
            "started_at": _OPT_STR,
            "wall_s": _OPT_NUM,
            "environment": {
                "type": "object",
                "required": ["python", "torch", "platform", "hostname"],
            },
            "summary": _object(
                {k: _COUNT for k in _SUMMARY_COUNTS},
                {"stopped_early": _COUNT, "inconclusive": _COUNT},
            ),
            "pairs": {"type": "array", "items": {"$ref": "#/$defs/pair"}},
        },
        {"plots": {"type": "object", "additionalProperties": _STR}},
    ),
    "$defs": {
        "curve": _CURVE,
        "side": _SIDE,
        "verdict": _VERDICT,
        "resource": _RESOURCE,
        "divergence_row": _DIVERGENCE_ROW,
        "attribution_run": _ATTRIBUTION_RUN,
        "pair": _PAIR,
    },
}


def default_environment() -> dict[str, Any]:
    """What is cheap to know about this machine (torch's version without importing it)."""
    torch_mod = sys.modules.get("torch")
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": str(getattr(torch_mod, "__version__", "")) or _version("torch"),
        "numpy": _version("numpy"),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "pytest_convergence": _version("pytest-convergence"),
    }
    if torch_mod is not None and getattr(torch_mod, "cuda", None) is not None:
        try:
            if torch_mod.cuda.is_available():
                env["devices"] = [
                    torch_mod.cuda.get_device_name(i) for i in range(torch_mod.cuda.device_count())
                ]
        except Exception:  # noqa: BLE001 - a broken driver must not break the report
            pass
    return env


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _iso(value: float | dt.datetime | str | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")
    return dt.datetime.fromtimestamp(float(value), dt.timezone.utc).isoformat(timespec="seconds")


def summarize(outcomes: Iterable[PairOutcome]) -> dict[str, int]:
    outcomes = list(outcomes)
    sides = [s for o in outcomes for s in (o.control, o.test) if s is not None]
    return {
        "pairs": len(outcomes),
        "passed": sum(o.status == "passed" for o in outcomes),
        "failed": sum(o.status == "failed" for o in outcomes),
        "inconclusive": sum(o.status == "inconclusive" for o in outcomes),
        "errors": sum(o.status == "error" for o in outcomes),
        "skipped": sum(o.status == "skipped" for o in outcomes),
        "cached_runs": sum(s.cached for s in sides),
        "fresh_runs": sum(not s.cached for s in sides),
        "stopped_early": sum(o.stopped_early_at is not None for o in outcomes),
    }


def cache_key_notes(outcomes: Iterable[PairOutcome]) -> dict[str, str]:
    """``{"cache_key": ...}`` when a control's run-cache key does not hold its trainer's code
    (Backend.code_identity: a command trainer without ``backend_options.sources``): reused
    controls may then be stale. One sentence per backend, in the backend's words."""
    unkeyed: dict[str, tuple[set[str], str]] = {}
    for o in outcomes:
        job = o.pair.control
        identity = _code_identity(job)
        if identity is not None and not identity.keyed:
            unkeyed.setdefault(job.backend, (set(), identity.note))[0].add(job.name)
    if not unkeyed:
        return {}
    return {
        "cache_key": "; ".join(
            f"{backend}-backend controls {', '.join(sorted(names))} are {note}"
            for backend, (names, note) in unkeyed.items()
        )
    }


def _code_identity(job: JobSpec) -> CodeIdentity | None:
    """None where the job's backend cannot be loaded here (a report of saved outcomes)."""
    try:
        return get_backend(job.backend).code_identity(job)
    except SpecError:
        return None


def floor_notes(outcomes: Iterable[PairOutcome]) -> list[str]:
    """Whose noise floors the paired/twin verdicts used -- the calibration of this stack, or
    the shipped CPU defaults and why (each verdict's ``details["floors"]``, run/judge.py):
    each distinct note once, in order. The terminal and the report both say it from here."""
    notes: dict[str, None] = {}
    for o in outcomes:
        for v in o.verdicts:
            floors = v.details.get("floors")
            if isinstance(floors, dict) and floors.get("note"):
                notes[str(floors["note"])] = None
    return list(notes)


def floors_notes(outcomes: Iterable[PairOutcome]) -> dict[str, str]:
    """``{"noise_floors": ...}`` for the report's environment; {} when no verdict used any."""
    notes = floor_notes(outcomes)
    return {"noise_floors": "; ".join(notes)} if notes else {}


def build_report(
    outcomes: Iterable[PairOutcome],
    *,
    environment: Mapping[str, Any],
    started_at: float | dt.datetime | str | None,
    wall_s: float | None,
    plots: Mapping[str, Mapping[str, str]] | None = None,
    plot_errors: Mapping[str, str] | None = None,
    report_dir: Path | None = None,
    include_curves: bool = True,
) -> ReportDocument:
    """The report.json document (valid against :data:`REPORT_JSON_SCHEMA`).

    ``environment`` adds to/overrides :func:`default_environment`. ``plots`` maps a pair id to
    ``{kind: path relative to the report folder}``, plus the key ``""`` for report-wide plots
    (the heatmap); without it the outcomes' own ``plots`` are used, relative to ``report_dir``.
    """
    outcomes = list(outcomes)
    plots = plots or {}
    records = []
    for o in outcomes:
        own = plots.get(o.pair.pair_id)
        if own is None:
            own = {
                f"plot{i}" if i else "pair": relative_plot(p, report_dir)
                for i, p in enumerate(o.plots)
            }
        records.append(
            pair_record(
                o,
                plots=own,
                include_curves=include_curves,
                plot_error=(plot_errors or {}).get(o.pair.pair_id),
            )
        )
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "generated_at": _iso(dt.datetime.now(dt.timezone.utc)),
        "started_at": _iso(started_at),
        "wall_s": jsonable(wall_s),
        "environment": jsonable(
            {
                **default_environment(),
                **cache_key_notes(outcomes),
                **floors_notes(outcomes),
                **environment,
            }
        ),
        "summary": summarize(outcomes),
        "plots": dict(plots.get("", {})),
        "pairs": records,
    }

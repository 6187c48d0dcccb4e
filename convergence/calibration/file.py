"""The calibration file: one JSON per stack, written by ``convergence calibrate``.

    {
      "schema": 1,
      "stack_hash": "3f0c...",                 # stack.stack_hash(stack)
      "stack": {"hardware": ..., "torch": ..., "accelerator": {...}, "env": {...}},
      "paired": {"loss": {"atol": .., "growth": .., "rtol": ..}, ...},     # fp32 floors
      "twin":   {"loss": {"k": .., "atol": .., "growth": .., "rtol": ..}, ...},  # bf16
      "obtained": {"source": "debug", "steps": 30, "layouts": [...], "date": "...",
                   "measured": {...}}          # how: the raw figures behind each value
    }

Its default place is ``<workdir>/calibration/<stack_hash>.json`` (the workdir is
``.convergence`` unless set), so a session finds the file for its own stack by name; the
``CONVERGENCE_CALIBRATION`` environment variable names a file anywhere else (a shared one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergence.spec.errors import SpecError

SCHEMA = 1
ENV_VAR = "CONVERGENCE_CALIBRATION"
"""A calibration file to use instead of ``<workdir>/calibration/<stack_hash>.json``."""

PAIRED_KEYS = ("atol", "growth", "rtol")
TWIN_KEYS = ("k", "atol", "growth", "rtol")
METHOD_KEYS = {"paired": PAIRED_KEYS, "twin": TWIN_KEYS}  # by comparison method


@dataclass(frozen=True, kw_only=True)
class Calibration:
    stack_hash: str
    stack: dict[str, Any]
    paired: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per metric: the paired method's atol / growth / rtol."""
    twin: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per metric: the twin method's k / atol / growth / rtol."""
    obtained: dict[str, Any] = field(default_factory=dict)
    """How the values were measured (experiment, steps, layouts, date, raw figures)."""

    def values(self, method: str, metric: str) -> dict[str, float]:
        """The calibrated parameters of comparison ``method`` for ``metric`` ({} when none)."""
        tables = {"paired": self.paired, "twin": self.twin}  # by the method they calibrate
        return dict(tables.get(method, {}).get(metric, {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "stack_hash": self.stack_hash,
            "stack": self.stack,
            "paired": self.paired,
            "twin": self.twin,
            "obtained": self.obtained,
        }


def default_path(work_dir: Path, stack_hash: str) -> Path:
    return Path(work_dir) / "calibration" / f"{stack_hash}.json"


def explicit_path(environ: Mapping[str, str] | None = None) -> Path | None:
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    return Path(value) if value else None


def write_calibration(calibration: Calibration, path: Path) -> Path:
    """Atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(calibration.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def _table(data: Mapping[str, Any], method: str, path: Path) -> dict[str, dict[str, float]]:
    raw = data.get(method, {})
    keys = METHOD_KEYS[method]
    if not isinstance(raw, Mapping):
        raise SpecError("must be a table of metrics", file=str(path), key=method, fix=_REWRITE)
    out: dict[str, dict[str, float]] = {}
    for metric, values in raw.items():
        if not isinstance(values, Mapping):
            raise SpecError(
                "must be a table", file=str(path), key=f"{method}.{metric}", fix=_REWRITE
            )
        row = {}
        for name, value in values.items():
            where = f"{method}.{metric}.{name}"
            if name not in keys:
                raise SpecError(
                    f"unknown parameter (known: {', '.join(keys)})",
                    file=str(path),
                    key=where,
                    fix=_REWRITE,
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise SpecError(
                    f"must be a number >= 0, got {value!r}", file=str(path), key=where, fix=_REWRITE
                )
            row[name] = float(value)
        out[str(metric)] = row
    return out


_REWRITE = "rerun `convergence calibrate` to rewrite the file, or delete it"


def load_calibration(path: Path) -> Calibration:
    """The file at ``path``; a SpecError naming the file, key and fix when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"cannot read: {exc}", file=str(path), fix=_REWRITE) from exc
    except ValueError as exc:
        raise SpecError(f"not JSON: {exc}", file=str(path), fix=_REWRITE) from exc
    if not isinstance(data, dict):
        raise SpecError("not a calibration (a JSON object)", file=str(path), fix=_REWRITE)
    if data.get("schema") != SCHEMA:
        raise SpecError(
            f"schema {data.get('schema')!r}, this version reads {SCHEMA}",
            file=str(path),
            key="schema",
            fix=_REWRITE,
        )
    stack = data.get("stack")
    stack_hash = data.get("stack_hash")
    if not isinstance(stack, dict) or not isinstance(stack_hash, str):
        raise SpecError("missing stack / stack_hash", file=str(path), key="stack", fix=_REWRITE)
    obtained = data.get("obtained", {})
    return Calibration(
        stack_hash=stack_hash,
        stack=stack,
        paired=_table(data, "paired", path),
        twin=_table(data, "twin", path),
        obtained=obtained if isinstance(obtained, dict) else {},
    )

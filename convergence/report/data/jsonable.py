"""Turning report values into strict JSON (no NaN literals) and back.

``json.dumps`` writes ``NaN``/``Infinity`` by default, which browsers and most JSON tools reject.
A diverged run has exactly such values (a NaN loss is a finding, not noise), so non-finite floats
are written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``; ``float()`` reads them back.
Finite floats are written with ``repr``, which round-trips a float64 exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import numpy as np

NON_FINITE: tuple[str, ...] = ("NaN", "Infinity", "-Infinity")


def encode_float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def jsonable(value: Any) -> Any:
    """A strict-JSON copy of ``value`` (Paths and unknown objects become strings)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return encode_float(float(value))
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    return str(value)


def read_float(value: Any) -> float:
    """Inverse of :func:`encode_float` (accepts numbers and the non-finite strings)."""
    return float(value)


def read_opt_float(value: Any) -> float | None:
    return None if value is None else float(value)

"""Compare two numerics probes (probe.json of the control and of the test): where do they part?

    loc = compare_probe_files(control_dir / "probe.json", test_dir / "probe.json")
    loc["module"]      # first module, in forward order, whose output norm differs (or None)
    loc["parameter"]   # first parameter whose gradient norm differs (or None)

The result is ``PairOutcome.localisation``: scalar keys first (what a failure message prints),
then the per-module and per-parameter tables (``modules``, ``parameters``) that the report
renders as a table. See convergence.rank.probe_norms for what the numbers are.

Tolerance: both probes ran the same forward+backward on the same weights and samples; only
the reduction order differs between layouts. Measured here in fp32 on CPU (DDP 2 vs FSDP 2 +
TP 2, debug model): module output norms agree to 1e-7 relative, gradient norms to 8e-8. The
fp32 default (rtol 1e-5, floor 1e-9) sits two orders above that; a lower-precision compute
dtype rounds every matmul, hence the looser bf16/fp16 defaults.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: (rtol, atol) per compute dtype (train config training.param_dtype).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-9),
    "bfloat16": (3e-2, 1e-5),
    "float16": (5e-3, 1e-6),
}


def tolerance_for(dtype: str) -> tuple[float, float]:
    """(rtol, atol) for a compute dtype; an unknown one gets the loosest."""
    return TOLERANCES.get(dtype, TOLERANCES["bfloat16"])


def _differs(a: float | None, b: float | None, rtol: float, atol: float) -> bool:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return not (a is None and b is None) and a != b
    return abs(a - b) > atol + rtol * max(abs(a), abs(b))


def _table(
    control: Sequence[Mapping[str, Any]],
    test: Sequence[Mapping[str, Any]],
    rtol: float,
    atol: float,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows in the control's forward order for names present on both sides; missing names."""
    by_name = {row["name"]: row for row in test}
    rows: list[dict[str, Any]] = []
    for row in control:
        other = by_name.get(row["name"])
        if other is None:
            continue
        c, t = row.get("norm"), other.get("norm")
        diff = rel = None
        if c is not None and t is not None:
            diff = abs(c - t)
            scale = max(abs(c), abs(t))
            rel = diff / scale if scale > 0 else 0.0
        rows.append(
            {
                "name": row["name"],
                "control": c,
                "test": t,
                "abs_diff": diff,
                "rel_diff": rel,
                "differs": _differs(c, t, rtol, atol),
            }
        )
    names_c = {row["name"] for row in control}
    missing = sorted(names_c.symmetric_difference(by_name))
    return rows, missing


def _first(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["differs"]), None)


def compare_probes(
    control: Mapping[str, Any],
    test: Mapping[str, Any],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> dict[str, Any]:
    """Localisation dict of two loaded probe.json documents (see the module docstring)."""
    # The looser of the two sides' compute dtypes decides.
    dtype = max(
        (str(side.get("param_dtype") or "float32") for side in (control, test)),
        key=lambda d: tolerance_for(d)[0],
    )
    default_rtol, default_atol = tolerance_for(dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    modules, missing_modules = _table(
        control.get("modules", []), test.get("modules", []), rtol, atol
    )
    params, missing_params = _table(control.get("grads", []), test.get("grads", []), rtol, atol)
    first_module, first_param = _first(modules), _first(params)
    loss_c, loss_t = control.get("loss"), test.get("loss")
    out: dict[str, Any] = {
        "module": first_module["name"] if first_module else None,
        "parameter": first_param["name"] if first_param else None,
        "max_abs_diff": first_module["abs_diff"]
        if first_module
        else max((r["abs_diff"] for r in modules if r["abs_diff"] is not None), default=0.0),
        "loss_control": loss_c,
        "loss_test": loss_t,
        "loss_differs": _differs(loss_c, loss_t, rtol, atol),
        "step": test.get("step", control.get("step")),
        "dtype": dtype,
        "rtol": rtol,
        "atol": atol,
        "modules_compared": len(modules),
        "modules_differing": sum(1 for r in modules if r["differs"]),
    }
    if control.get("dp_losses") is not None or test.get("dp_losses") is not None:
        out["dp_losses_control"] = control.get("dp_losses")
        out["dp_losses_test"] = test.get("dp_losses")
    if missing_modules or missing_params:
        # Names on one side only: a wrapper this module does not know, or a different model.
        out["unmatched"] = missing_modules + missing_params
    out["modules"] = modules
    out["parameters"] = params
    return out


def load_probe(path: Path) -> dict[str, Any]:
    """Read a probe.json; a clear error when it is missing or not a probe."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"no probe result at {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "modules" not in data or "grads" not in data:
        raise ValueError(f"{path} is not a probe.json (no 'modules'/'grads')")
    return data


def compare_probe_files(
    control: Path, test: Path, *, rtol: float | None = None, atol: float | None = None
) -> dict[str, Any]:
    return compare_probes(load_probe(control), load_probe(test), rtol=rtol, atol=atol)


#: Keys of the localisation dict that hold tables (not one-line values).
TABLE_KEYS: tuple[str, ...] = ("modules", "parameters")


def summary_items(localisation: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The one-line entries of a localisation dict (tables and long lists left out)."""
    return [
        (k, v)
        for k, v in localisation.items()
        if k not in TABLE_KEYS and not isinstance(v, (list, dict))
    ]

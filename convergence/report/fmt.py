"""Short text forms of report values: the one place numbers and cells are formatted, shared by
every section and output format (terminal, markdown, HTML, JUnit, plots)."""

from __future__ import annotations

import math
from collections.abc import Mapping

VERDICTS = {
    "passed": "PASS",
    "failed": "FAIL",
    "inconclusive": "INCONCLUSIVE",
    "error": "ERROR",
    "skipped": "SKIP",
}

#: Short names for technique fields in the matrix (the report keeps full names).
TECHNIQUE_ABBREV = {
    "param_dtype": "param",
    "reduce_dtype": "reduce",
    "activation_checkpoint": "ac",
    "compile": "compile",
    "reshard_after_forward": "reshard",
    "cpu_offload": "offload",
    "grad_accum_steps": "accum",
    "deterministic": "determ",
    "float8_all_gather": "f8ag",
    "hook": "hook",
}
DTYPE_ABBREV = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def fmt_deg(degree: int) -> str:
    return "-" if degree == 1 else str(degree)


def as_float(value: float | str | None) -> float | None:
    """A report number back to float (report dicts hold "NaN"/"Infinity" as strings)."""
    return None if value is None else float(value)


def fmt_num(value: float | str | None) -> str:
    value = as_float(value)
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if value == 0:
        return "0"
    return f"{value:.1e}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.3g}"


def fmt_float(value: object) -> str:
    """A number in a sentence of the failure text: six significant digits, small ones in
    scientific notation; anything else (None: "-") as its ``str``."""
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return "-" if value is None else str(value)


def fmt_amount(value: float | str | None) -> str:
    """Throughput / memory: whole numbers with thousands separators once they are large."""
    value = as_float(value)
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def fmt_ratio(value: float | str | None) -> str:
    value = as_float(value)
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def fmt_value(value: float | str | None) -> str:
    """A curve value at full useful precision (divergence tables): ``2.302585093``."""
    value = as_float(value)
    return "-" if value is None else f"{value:.10g}"


def fmt_delta(value: float | str | None) -> str:
    """A signed difference (divergence tables): ``+1.250e-03``."""
    value = as_float(value)
    return "-" if value is None else f"{value:+.3e}"


def fmt_pct(fraction: float | None) -> str:
    """A relative difference as a signed percentage: 0.021 -> ``+2.1%``."""
    return "-" if fraction is None else f"{fraction * 100:+.1f}%"


def cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the last one an ellipsis when cut."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def fmt_wall(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 100:
        return f"{seconds:.1f}s"
    if seconds < 6000:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def fmt_techniques(changed: Mapping[str, object]) -> str:
    parts = []
    for key, value in changed.items():
        name = TECHNIQUE_ABBREV.get(key, key)
        if value is True:
            parts.append(name)
        elif value is False:
            parts.append(f"no-{name}")
        elif key == "hook":
            parts.append(f"hook:{str(value).rsplit(':', 1)[-1]}")
        else:
            parts.append(f"{name}:{DTYPE_ABBREV.get(str(value), value)}")
    return ",".join(parts) or "-"


def describe_test(short_name: str, changed: Mapping[str, object]) -> str:
    """``fsdp2-tp2`` or, for a technique pair on the same layout, ``fsdp2 +param:bf16``."""
    techniques = fmt_techniques(changed)
    return short_name if techniques == "-" else f"{short_name} +{techniques}"


def verdict_state(
    passed: bool,
    gate: bool,
    steps_compared: int = 1,
    not_compared: bool = False,
    inconclusive: bool = False,
) -> str:
    """One metric's verdict as a word: "pass", "FAIL", or -- for a metric that does not gate
    (tokens/s, memory by default) -- "regressed (report only)", which never reads as a failure
    of the pair, or "not compared (report only)" when a side did not log it. A gating metric
    a run did not log reads "not compared" (amber, with the fix), never "pass"."""
    if not_compared:
        return "not compared"
    if passed:
        return "pass"
    if inconclusive:  # not enough evidence either way: never a pass (stats/noninferiority.py)
        return "INCONCLUSIVE" if gate else "inconclusive (report only)"
    if gate:
        return "FAIL"
    return "regressed (report only)" if steps_compared else "not compared (report only)"


NOT_COMPARED_TITLE = "Not compared (gating metrics a run did not log)"

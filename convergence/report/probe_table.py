"""The numerics probe's per-module table (PairOutcome.localisation) as report rows.

Shared by the markdown and HTML reports; see convergence.probe_compare for the dict's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from convergence.report.fmt import fmt_num

HEADER: tuple[str, ...] = ("module", "control norm", "test norm", "|Δ|", "rel Δ", "")
RIGHT: tuple[bool, ...] = (False, True, True, True, True, False)
#: Titles of the two tables, by localisation key.
TABLES: tuple[tuple[str, str], ...] = (("modules", "Module output norms (forward order)"),
                                       ("parameters", "Gradient norms (forward order)"))


def has_probe_table(record: Mapping[str, Any]) -> bool:
    loc = record.get("localisation")
    return isinstance(loc, Mapping) and isinstance(loc.get("modules"), list)


def summary_text(loc: Mapping[str, Any]) -> str:
    """One line: the first differing module/parameter, or agreement, or the probe's error."""
    if loc.get("error"):
        return f"numerics probe failed: {loc['error']}"
    step = loc.get("step")
    if loc.get("module") is None and loc.get("parameter") is None:
        return (f"step {step}: all {loc.get('modules_compared')} module outputs and gradients "
                f"agree (rtol {loc.get('rtol')}, atol {loc.get('atol')})")
    return (f"step {step}: first differing module `{loc.get('module')}` "
            f"(|Δ norm| {fmt_num(loc.get('max_abs_diff'))}), first differing gradient "
            f"`{loc.get('parameter')}`; {loc.get('modules_differing')} of "
            f"{loc.get('modules_compared')} modules differ; loss {fmt_num(loc.get('loss_control'))}"
            f" vs {fmt_num(loc.get('loss_test'))}")


def rows(entries: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    return [[str(e.get("name")), fmt_num(e.get("control")), fmt_num(e.get("test")),
             fmt_num(e.get("abs_diff")), fmt_num(e.get("rel_diff")),
             "differs" if e.get("differs") else ""] for e in entries]

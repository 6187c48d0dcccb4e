"""The "Reduced-communication blocks" table and plot (experiments/comm_reduction.toml).

A pair belongs to the study when its test's block pattern (`model.block_pattern`) differs from
its control's. One table per experiment file and control: the control (the all-standard TP
model, the baseline) first, then each test with its block pattern, the collectives it issued
in one step (counted by the trainer, convergence.trainer.comm_count), its parameter count, its
final validation loss and the difference to the baseline's, its tokens/s, and the verdict (the
validation-loss threshold rule of the pair). The plot puts the collectives per step against
the final validation loss and against tokens/s.

Rendered from report.json pair records: each side's ``run_facts`` (filled from the trainer's
run_meta.json by :func:`convergence.report.data.records.side_facts`) and ``resources``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from convergence.report.data.records import PairRecord, ResourceRecord, RunFacts, SideRecord
from convergence.report.data.schema import ReportDocument
from convergence.report.figure import new_figure, save_png
from convergence.report.fmt import VERDICTS, as_float, fmt_amount, fmt_pct
from convergence.report.markup import (
    TitledTable,
    html_img,
    html_tables_section,
    md_cell,
    md_table,
)

TITLE = "Reduced-communication blocks"
PLOT_NAME = "comm_reduction.png"
PLOT_KEY = "comm_reduction"
HEADER: tuple[str, ...] = (
    "config",
    "block pattern",
    "collectives/step",
    "fwd / bwd",
    "params",
    "final val loss",
    "Δ val loss",
    "tokens/s",
    "Δ tokens/s",
    "verdict",
)
RIGHT: tuple[bool, ...] = (False, False, True, True, True, True, True, True, True, False)
NOTE = (
    "Collectives issued in one optimizer step (forward + backward, all ranks alike; "
    "counted with CommDebugMode on step 1), parameters of the full model, validation "
    "loss at the last evaluation, Δ against the baseline (the control), median tokens/s. "
    "The verdict is the pair's: the validation-loss threshold rule of the experiment."
)


@dataclass(frozen=True, kw_only=True)
class CommRow:
    config: str
    role: str
    """"baseline" (the control) or "test"."""
    block_pattern: str
    collectives: int | None
    forward: int | None
    backward: int | None
    num_params: int | None
    val_loss: float | None
    val_loss_delta: float | None
    tokens_per_s: float | None
    tokens_per_s_rel: float | None
    verdict: str


@dataclass(frozen=True, kw_only=True)
class CommTable:
    source: str
    rows: tuple[CommRow, ...]


def _facts(side: SideRecord) -> RunFacts:
    facts = side.get("run_facts")
    return facts if isinstance(facts, Mapping) else {}


def _pattern(side: SideRecord) -> str | None:
    value = _facts(side).get("block_pattern")
    return str(value) if value else None


def in_study(record: PairRecord) -> bool:
    """Test and control ran with different block patterns."""
    test, control = _pattern(record["test"]), _pattern(record["control"])
    return test is not None and control is not None and test != control


def _count(facts: RunFacts, key: str) -> int | None:
    counts = facts.get("collectives")
    value = counts.get(key) if isinstance(counts, Mapping) else None
    return int(value) if isinstance(value, (int, float)) else None


def _row(
    name: str,
    role: str,
    side: SideRecord,
    *,
    tokens: float | None,
    tokens_rel: float | None,
    baseline_val: float | None,
    verdict: str,
) -> CommRow:
    facts = _facts(side)
    val = as_float(facts.get("final_val_loss"))
    params = facts.get("num_params")
    return CommRow(
        config=name,
        role=role,
        block_pattern=str(facts.get("block_pattern") or "-"),
        collectives=_count(facts, "total"),
        forward=_count(facts, "forward"),
        backward=_count(facts, "backward"),
        num_params=int(params) if isinstance(params, (int, float)) else None,
        val_loss=val,
        val_loss_delta=(
            val - baseline_val
            if val is not None and baseline_val is not None and role != "baseline"
            else None
        ),
        tokens_per_s=tokens,
        tokens_per_s_rel=tokens_rel,
        verdict=verdict,
    )


def _verdict(record: PairRecord, baseline_val: float | None) -> str:
    """ "PASS (limit +2.0%)": the pair's verdict and its val_loss threshold, relative."""
    status = VERDICTS.get(str(record["status"]), str(record["status"]))
    for verdict in record.get("verdicts") or []:
        if verdict.get("metric") != "val_loss":
            continue
        limit = as_float(verdict.get("tolerance_at_max"))
        if verdict.get("method") == "regression" and limit is not None and baseline_val:
            return f"{status} (limit {limit / abs(baseline_val) * 100:+.1f}%)"
        return f"{status} ({verdict.get('method')})"
    return status


def _tokens(record: PairRecord) -> ResourceRecord:
    entry = (record.get("resources") or {}).get("tokens_per_s")
    return entry if entry else {"control": None, "test": None, "ratio": None}


def tables(pairs: Sequence[PairRecord]) -> list[CommTable]:
    """One table per (experiment file, control), the baseline row first."""
    groups: dict[tuple[str, str], list[PairRecord]] = {}
    for record in pairs:
        if in_study(record):
            groups.setdefault((str(record["source"]), str(record["control"]["name"])), []).append(
                record
            )
    out = []
    for (source, _), records in groups.items():
        first = records[0]
        tokens = _tokens(first)
        baseline_val = as_float(_facts(first["control"]).get("final_val_loss"))
        rows = [
            _row(
                str(first["control"]["name"]),
                "baseline",
                first["control"],
                tokens=as_float(tokens.get("control")),
                tokens_rel=None,
                baseline_val=baseline_val,
                verdict="baseline",
            )
        ]
        for record in records:
            entry = _tokens(record)
            ratio = as_float(entry.get("ratio"))
            rows.append(
                _row(
                    str(record["test"]["name"]),
                    "test",
                    record["test"],
                    tokens=as_float(entry.get("test")),
                    tokens_rel=None if ratio is None else ratio - 1.0,
                    baseline_val=baseline_val,
                    verdict=_verdict(record, baseline_val),
                )
            )
        out.append(CommTable(source=source, rows=tuple(rows)))
    return out


def _int(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _delta(row: CommRow) -> str:
    if row.val_loss_delta is None or row.val_loss is None:
        return "-"
    base = row.val_loss - row.val_loss_delta
    rel = f" ({row.val_loss_delta / base * 100:+.2f}%)" if base else ""
    return f"{row.val_loss_delta:+.4f}{rel}"


def cells(row: CommRow) -> list[str]:
    fwd_bwd = "-" if row.forward is None else f"{row.forward} / {row.backward}"
    rel = fmt_pct(row.tokens_per_s_rel)
    return [
        row.config,
        row.block_pattern,
        _int(row.collectives),
        fwd_bwd,
        _int(row.num_params),
        "-" if row.val_loss is None else f"{row.val_loss:.4f}",
        _delta(row),
        fmt_amount(row.tokens_per_s),
        rel,
        row.verdict,
    ]


def markdown_lines(report: ReportDocument) -> list[str]:
    """The section of report.md ([] when no pair of the report is in the study)."""
    found = tables(report["pairs"])
    if not found:
        return []
    lines = ["", f"## {TITLE}", "", NOTE]
    for t in found:
        lines += ["", f"### {md_cell(Path(t.source).name)}", ""]
        lines += md_table(HEADER, [cells(r) for r in t.rows], list(RIGHT))
    plot = (report.get("plots") or {}).get(PLOT_KEY)
    if plot:
        lines += ["", f"![collectives per step vs validation loss and tokens/s]({plot})"]
    return lines


def html_section(report: ReportDocument, plot_files: Mapping[str, Path]) -> str:
    """The section of report.html ("" when no pair of the report is in the study)."""
    found = tables(report["pairs"])
    if not found:
        return ""
    parts = [
        html_tables_section(
            TITLE,
            NOTE,
            HEADER,
            RIGHT,
            [TitledTable(Path(t.source).name, [cells(row) for row in t.rows]) for t in found],
        ),
        html_img(
            (report.get("plots") or {}).get(PLOT_KEY),
            plot_files,
            "collectives per step vs validation loss and tokens/s",
        ),
    ]
    return "".join(parts)


def write_plot(pairs: Sequence[PairRecord], plot_dir: Path) -> Path | None:
    """PNG: collectives per step vs final validation loss (left) and tokens/s (right), one
    series per experiment file; None when no pair is in the study."""
    found = tables(pairs)
    if not found:
        return None
    fig = new_figure(11.0, 4.2)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.88, bottom=0.13, wspace=0.25)
    for t in found:
        rows = [r for r in t.rows if r.collectives is not None]
        counts = [int(r.collectives or 0) for r in rows]  # not None: filtered above
        label = Path(t.source).name
        for ax, values in (
            (left, [r.val_loss for r in rows]),
            (right, [r.tokens_per_s for r in rows]),
        ):
            points = [
                (r, n, v)
                for r, n, v in zip(rows, counts, values, strict=True)
                if v is not None and math.isfinite(v)
            ]
            if not points:
                continue
            ax.plot([n for _, n, _ in points], [v for _, _, v in points], "o", label=label)
            for r, n, v in points:
                marker = "*" if r.role == "baseline" else ""
                ax.annotate(
                    f"{marker}{r.config}",
                    (n, v),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                )
    from matplotlib.ticker import MaxNLocator  # lazy, like every matplotlib import

    for ax, name in ((left, "final validation loss"), (right, "tokens/s (median)")):
        ax.set_xlabel("collectives per step (forward + backward)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no 7.5 tick
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.margins(x=0.2, y=0.15)  # room for the labels
    left.legend(fontsize=7)
    fig.suptitle(f"{TITLE}: communication vs quality and speed (* = baseline)", fontsize=10)
    return save_png(fig, plot_dir / PLOT_NAME)

"""report.html: one self-contained file (inline CSS, plots embedded as base64 PNG data URIs).

Rendered from the report.json document, so it can be rebuilt from a saved report. Every
string from a run (names, messages, tracebacks) is escaped: error text is attacker-free but
full of ``<`` and ``&``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from convergence.report.data.records import PairRecord, ResourceRecord, SideRecord, not_compared
from convergence.report.data.schema import ReportDocument
from convergence.report.fmt import (
    NOT_COMPARED_TITLE,
    as_float,
    fmt_amount,
    fmt_delta,
    fmt_num,
    fmt_ratio,
    fmt_value,
    fmt_wall,
    verdict_state,
)
from convergence.report.formats.terminal import COLUMNS, RIGHT, record_row, with_device
from convergence.report.markup import html_img as img
from convergence.report.markup import html_table as table
from convergence.report.sections import SECTIONS
from convergence.report.sections.probe import summary_text

CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       margin: 24px auto; max-width: 1240px; padding: 0 16px; color: #1f2328; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin-top: 32px; }
h3 { font-size: 16px; margin: 0 0 6px; }
.sub { color: #59636e; font-size: 12px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #d1d9e0; padding: 3px 8px; text-align: left; white-space: nowrap; }
td.wrap { white-space: normal; min-width: 14em; }
th { background: #f6f8fa; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.passed td.verdict { background: #dafbe1; color: #116329; font-weight: 600; }
tr.failed td.verdict { background: #ffebe9; color: #a40e26; font-weight: 600; }
tr.error td.verdict { background: #fff1c2; color: #7d4e00; font-weight: 600; }
tr.inconclusive td.verdict { background: #fff1c2; color: #7d4e00; font-weight: 600; }
tr.skipped td.verdict { background: #eaeef2; }
.pair { border: 1px solid #d1d9e0; border-left-width: 6px; border-radius: 6px;
        padding: 12px 16px; margin: 16px 0; }
.pair.passed { border-left-color: #1a7f37; } .pair.failed { border-left-color: #cf222e; }
.pair.error { border-left-color: #bf8700; } .pair.inconclusive { border-left-color: #bf8700; } .pair.skipped { border-left-color: #8c959f; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
         font-weight: 600; color: white; vertical-align: middle; }
.badge.passed { background: #1a7f37; } .badge.failed { background: #cf222e; }
.badge.error { background: #bf8700; } .badge.inconclusive { background: #bf8700; } .badge.skipped { background: #8c959f; }
.ok { color: #116329; } .bad { color: #a40e26; font-weight: 600; }
.warn { color: #9a6700; font-weight: 600; }
img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; font-size: 12px; }
dl.kv { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; margin: 6px 0; }
dl.kv dt { color: #59636e; } dl.kv dd { margin: 0; }
"""


def matrix_html(pairs: Sequence[PairRecord]) -> str:
    records = [record_row(record) for record in pairs]
    columns = with_device(COLUMNS, records)
    keys = [key for key, _ in columns]
    rows = []
    for record, row in zip(pairs, records, strict=True):
        cells = [escape(row[k]) for k in keys]
        cells[0] = f'<a href="#{escape(_anchor(record))}">{cells[0]}</a>'
        rows.append(cells)
    return table(
        [escape(t) for _, t in columns],
        rows,
        right=[k in RIGHT for k in keys],
        row_class=[str(r["status"]) for r in pairs],
        cell_class={keys.index("verdict"): "verdict"},
    )


def _anchor(record: PairRecord) -> str:
    return "pair-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in record["id"])


def _kv(items: Sequence[tuple[str, str]]) -> str:
    return (
        '<dl class="kv">' + "".join(f"<dt>{escape(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"
    )


def _layout_text(side: SideRecord) -> str:
    degrees = ", ".join(f"{a}={d}" for a, d in side["degrees"].items() if d > 1) or "single"
    extra = f", schedule {side['pp_schedule']}" if side.get("pp_schedule") else ""
    return (
        f"<code>{escape(side['short_name'])}</code> ({escape(degrees)}{escape(extra)}; "
        f"{side['world_size']} ranks)"
    )


def _state_span(
    passed: bool,
    gate: bool,
    steps_compared: int,
    not_compared: bool = False,
    inconclusive: bool = False,
) -> str:
    """pass (green), FAIL (red), or in amber a non-gating regression (never shown as a FAIL),
    a gating metric that was not compared or an inconclusive one (never shown as a pass)."""
    css = (
        "warn"
        if not_compared or inconclusive
        else ("ok" if passed else ("bad" if gate else "warn"))
    )
    state = verdict_state(passed, gate, steps_compared, not_compared, inconclusive)
    return f'<span class="{css}">{escape(state)}</span>'


def not_compared_html(pairs: Sequence[PairRecord]) -> str:
    """Every pair's gating metrics that a run did not log, with the fix (amber)."""
    items = [
        f'<li><code>{escape(p["name"])}</code>: <span class="warn">'
        f"{escape(v['metric'])} not compared</span> -- {escape(v['message'])}</li>"
        for p, v in not_compared(pairs)
    ]
    return f"<h2>{escape(NOT_COMPARED_TITLE)}</h2><ul>{''.join(items)}</ul>" if items else ""


def verdicts_html(record: PairRecord) -> str:
    rows = []
    for v in record["verdicts"]:
        ok = v["passed"]
        rows.append(
            [
                escape(v["metric"]),
                escape(v["method"]),
                _state_span(
                    ok,
                    bool(v["gate"]),
                    int(v.get("steps_compared", 1)),
                    bool(v.get("not_compared", False)),
                    bool(v.get("inconclusive", False)),
                ),
                "yes" if v["gate"] else "no",
                escape(
                    str(v["first_divergent_step"] if v["first_divergent_step"] is not None else "-")
                ),
                escape(fmt_num(v["max_deviation"])),
                escape(str(v["max_deviation_step"] or "-")),
                escape(
                    f"{fmt_num(v['tolerance_at_max'])} ({v['tolerance']})"
                    if v["tolerance"]
                    else fmt_num(v["tolerance_at_max"])
                ),
                escape(", ".join(f"{k}={fmt_num(p)}" for k, p in v["p_values"].items()) or "-"),
                escape(v["message"]),
            ]
        )
    if not rows:
        return '<p class="sub">no verdicts</p>'
    header = [
        "metric",
        "method",
        "verdict",
        "gate",
        "first divergent step",
        "max |Δ|",
        "at step",
        "tolerance",
        "p-values",
        "message",
    ]
    return table(
        header,
        rows,
        right=[False] * 4 + [True, True, True] + [False] * 3,
        cell_class={7: "wrap", 9: "wrap"},
    )


def divergence_html(record: PairRecord) -> str:
    parts = []
    reference = str(record.get("delta_reference") or "control")
    for metric, rows in record["divergence"].items():
        body = [
            [str(r["step"]), fmt_value(r["control"]), fmt_value(r["test"]), fmt_delta(r["delta"])]
            for r in rows
        ]
        parts.append(
            f"<p><b>{escape(metric)}</b> around the divergence</p>"
            + table(["step", reference, "test", "Δ"], body, right=[True] * 4)
        )
    return "".join(parts)


def _resource(entry: ResourceRecord) -> str:
    return (
        f"{fmt_amount(entry['test'])} / {fmt_amount(entry['control'])} = "
        f"{fmt_ratio(entry['ratio'])}"
    )


def pair_html(record: PairRecord, plot_files: Mapping[str, Path]) -> str:
    status = str(record["status"])
    res = record["resources"]
    wall = record["wall_s"]
    items = [
        ("source", f"<code>{escape(record['source'])}</code>"),
        (
            "control",
            _layout_text(record["control"])
            + (" — <i>from cache</i>" if record["cached"]["control"] else ""),
        ),
        ("test", _layout_text(record["test"])),
        (
            "techniques changed",
            escape(
                ", ".join(f"{k}={v}" for k, v in record["techniques_changed"].items()) or "none"
            ),
        ),
        ("regime", escape(record["regime"])),
        ("tokens/s (test / control)", escape(_resource(res["tokens_per_s"]))),
        ("peak memory MiB (test / control)", escape(_resource(res["peak_mem_mib"]))),
        (
            "wall (pair, control, test)",
            escape(", ".join(fmt_wall(as_float(wall[k])) for k in ("pair", "control", "test"))),
        ),
    ]
    resume = record.get("resume")
    if resume is not None:
        items.append(
            (
                "resume",
                escape(
                    f"checkpoint after step {resume['at_step']}, "
                    f"{resume['before']} → {resume['after']}"
                    + (f": {resume['note']}" if resume["note"] else "")
                ),
            )
        )
    if record["first_divergent_step"] is not None:
        items.append(
            ("first divergent step", f'<span class="bad">{record["first_divergent_step"]}</span>')
        )
    if record["stopped_early_at"] is not None:
        items.append(("stopped early at step", str(record["stopped_early_at"])))
    if record["localisation"]:
        # The sentence the failure message and report.md show, not a key=value dump.
        items.append(
            (
                "localisation (numerics probe)",
                escape(summary_text(record["localisation"]).replace("`", "")),
            )
        )
    error = f"<pre>{escape(record['error'])}</pre>" if record["error"] else ""
    plot_error = (
        f'<p class="bad">plot failed: {escape(record["plot_error"] or "")}</p>'
        if record.get("plot_error")
        else ""
    )
    plots = "".join(
        img(rel, plot_files, f"{record['name']} {kind}") for kind, rel in record["plots"].items()
    )
    return (
        f'<section class="pair {escape(status)}" id="{escape(_anchor(record))}">'
        f'<h3>{escape(record["name"])} <span class="badge {escape(status)}">'
        f"{escape(status.upper())}</span></h3>"
        f'<div class="sub">{escape(record["id"])}</div>'
        f"{_kv(items)}{error}{verdicts_html(record)}{divergence_html(record)}"
        f"{''.join(s.pair_html(record) for s in SECTIONS if s.pair_html)}"
        f"{plot_error}{plots}</section>"
    )


def render_html(report: ReportDocument, plot_files: Mapping[str, Path]) -> str:
    """The whole report as one HTML document.

    ``plot_files`` maps a plot path as written in the report (relative to the report folder)
    to the PNG on disk; those are embedded, so the file can be mailed or attached alone.
    """
    summary = report["summary"]
    pairs = report["pairs"]
    bad = summary["failed"] + summary["errors"]
    errors = summary["errors"]
    undecided = summary.get("inconclusive", 0)
    title = (
        f"Convergence: {summary['passed']} passed, {summary['failed']} failed, "
        + (f"{undecided} inconclusive, " if undecided else "")
        + f"{errors} error{'' if errors == 1 else 's'} "
        f"({summary['pairs']} pair{'' if summary['pairs'] == 1 else 's'})"
    )
    overall = "failed" if bad else "inconclusive" if undecided else "passed"
    wall = (
        ""
        if report.get("wall_s") is None
        else f" · wall {escape(fmt_wall(as_float(report['wall_s'])))}"
    )
    env = _kv([(str(k), escape(str(v))) for k, v in report["environment"].items()])
    failing = [p for p in pairs if p["status"] in ("failed", "inconclusive", "error")]
    ordered = failing + [p for p in pairs if p not in failing]
    sections = "\n".join(s.html(report, plot_files) for s in SECTIONS if s.html)
    pair_sections = "".join(pair_html(r, plot_files) for r in ordered)

    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title><style>{CSS}</style></head>
<body>
<h1><span class="badge {overall}">{overall.upper()}</span> {escape(title)}</h1>
<div class="sub">generated {escape(str(report["generated_at"]))} · schema v{report["schema_version"]}
{wall} · {summary["cached_runs"]} cached / {summary["fresh_runs"]} fresh runs</div>
<h2>Matrix</h2>
{matrix_html(pairs)}
<div class="sub">Axis degrees are the test's ("-" = 1). |Δ| = max |test − control| (seed regime:
 − centre of the control replicates' band). tok/s and mem: test / control. * = stopped early.</div>
{not_compared_html(pairs)}
{sections}
<h2>Pairs</h2>
{pair_sections}
<h2>Environment</h2>
{env}
</body></html>
"""

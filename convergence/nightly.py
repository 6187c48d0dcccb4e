"""Nightly runs under Slurm: the sbatch script, the history file and the trend report.

    convergence nightly --experiments experiments/ --out /shared/conv-nightly [--submit]
        writes OUT/nightly.sbatch (see scripts/nightly.sbatch, the documented example). Each
        night it runs ``pytest -m convergence --convergence-tier nightly --convergence-launcher
        slurm --junitxml ... --convergence-report ...`` and then ``convergence record`` appends
        the night's results to OUT/history.jsonl.
    convergence record REPORT.json HISTORY.jsonl --night NAME
        one JSON line per pair: final loss delta, tokens/s, peak memory, verdict.
    convergence trend HISTORY.jsonl --out DIR
        DIR/trend.md, DIR/trend.json and DIR/trend.png (per pair, across nights).

The history is JSONL so that appending is atomic enough for one writer a night and a broken
night (a truncated line) never hides the others: unreadable lines are skipped and counted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergence.spec.errors import SpecError

HISTORY_VERSION = 1
TREND_METRICS: tuple[tuple[str, str], ...] = (
    ("final_loss_delta", "final loss Δ (test − control)"),
    ("tokens_per_s", "tokens/s (test)"),
    ("peak_mem_mib", "peak memory MiB (test)"),
)


# -- the sbatch script ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class NightlySettings:
    """What ``convergence nightly`` puts into the sbatch script."""

    experiments: tuple[str, ...]
    """Experiment TOML files or folders, as pytest arguments (relative to ``rootdir``)."""
    out: str
    """Folder for the nights (``nights/<night>/``), Slurm output and ``history.jsonl``."""
    rootdir: str = "."
    """Where pytest runs (the project checkout)."""
    history: str | None = None
    """History file; default ``<out>/history.jsonl``."""
    python: str = sys.executable
    nodes: int = 1
    time: str = "08:00:00"
    job_name: str = "convergence-nightly"
    partition: str | None = None
    gpus_per_node: int | None = None
    exclusive: bool = True
    """Whole nodes: the allocation's CPUs/GPUs all belong to the night's jobs (timings stay
    comparable across nights)."""
    sbatch_options: tuple[str, ...] = ()
    """Extra ``#SBATCH`` lines' options, e.g. ``--account=ml`` or ``--exclusive``."""
    pytest_args: tuple[str, ...] = ()
    """Extra pytest arguments, e.g. ``-n 4`` or ``--convergence-refresh``."""

    def __post_init__(self) -> None:
        if not self.experiments:
            raise SpecError("no experiments given", key="--experiments",
                            fix="pass experiment TOML files or folders")
        if self.nodes < 1:
            raise SpecError("must be at least 1", key="--nodes", fix="use --nodes 1 or more")

    @property
    def history_path(self) -> str:
        return self.history or f"{self.out}/history.jsonl"


_HEADER = """\
#!/bin/bash
# Nightly loss-convergence run (pytest-convergence), written by `convergence nightly`.
#
#   sbatch {script}            # or: sbatch --begin=20:00 {script}; cron/scrontab for nightly
#
# Each night:
#   1. pytest -m convergence --convergence-tier nightly --convergence-launcher slurm runs every
#      pair of the experiments below; each job is one `srun ... torchrun` step of this
#      allocation (rendezvous on the first node). JUnit XML and report.json/.md/.html + plots
#      go to $OUT/nights/<night>/.
#   2. `convergence record` appends one line per pair (final loss delta, tokens/s, peak
#      memory, verdict) to the history file, even when pairs failed.
#   3. `convergence trend` rewrites $OUT/trend/ (trend.md, trend.json, trend.png) from the
#      whole history, so the latest trend is always next to the nights.
#   4. The script exits with pytest's status, so Slurm marks a failing night as FAILED.
#
# Edit the #SBATCH lines for your site (partition, account, GPUs), or regenerate with
#   convergence nightly --experiments ... --out ... [--partition P] [--gpus-per-node G] ...
"""

_BODY = """\
set -uo pipefail

cd {rootdir}
OUT={out}
HISTORY={history}
PYTHON={python}
NIGHT="$(date -u +%Y%m%dT%H%M%SZ)-${{SLURM_JOB_ID:-nojob}}"
NIGHT_DIR="$OUT/nights/$NIGHT"
mkdir -p "$NIGHT_DIR"
export MPLBACKEND=Agg

"$PYTHON" -m pytest -m convergence --convergence-tier nightly --convergence-launcher slurm \\
    --junitxml "$NIGHT_DIR/junit.xml" --convergence-report "$NIGHT_DIR/report" \\
    -p no:cacheprovider{pytest_args} \\
    {experiments}
status=$?

if [ -f "$NIGHT_DIR/report/report.json" ]; then
    "$PYTHON" -m convergence.cli record "$NIGHT_DIR/report/report.json" "$HISTORY" \\
        --night "$NIGHT" --pytest-status "$status" || status=$((status == 0 ? 3 : status))
else
    echo "no report.json for night $NIGHT (pytest exit status $status)" >&2
    status=$((status == 0 ? 3 : status))
fi
if [ -f "$HISTORY" ]; then
    # the trend across every night so far; a failure here never hides the night's own status
    "$PYTHON" -m convergence.cli trend "$HISTORY" --out "$OUT/trend" \\
        || echo "trend report failed for night $NIGHT" >&2
fi
exit $status
"""


def _q(text: str) -> str:
    return shlex.quote(text)


def render_sbatch(settings: NightlySettings, *, script_name: str = "nightly.sbatch") -> str:
    """The sbatch script for ``settings`` (a bash script with ``#SBATCH`` lines)."""
    lines = [_HEADER.format(script=script_name, history=settings.history_path)]
    sbatch = [f"--job-name={settings.job_name}", f"--nodes={settings.nodes}",
              "--ntasks-per-node=1", f"--time={settings.time}",
              f"--output={settings.out}/slurm-%j.out"]
    if settings.partition:
        sbatch.append(f"--partition={settings.partition}")
    if settings.gpus_per_node:
        sbatch.append(f"--gpus-per-node={settings.gpus_per_node}")
    if settings.exclusive:
        sbatch.append("--exclusive")
    sbatch.extend(settings.sbatch_options)
    lines.extend(f"#SBATCH {opt}" for opt in sbatch)
    lines.append("")
    extra = "".join(f" {_q(a)}" for a in settings.pytest_args)
    lines.append(_BODY.format(rootdir=_q(settings.rootdir), out=_q(settings.out),
                              history=_q(settings.history_path), python=_q(settings.python),
                              pytest_args=extra,
                              experiments=" ".join(_q(e) for e in settings.experiments)))
    return "\n".join(lines)


def write_sbatch(settings: NightlySettings, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_sbatch(settings, script_name=str(path)))
    path.chmod(0o755)
    return path


# -- the history ----------------------------------------------------------------------------

def _num(value: Any) -> float | None:
    """A report number (non-finite ones are strings there) as a float; None if absent."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _json_num(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def final_loss_delta(pair: Mapping[str, Any]) -> tuple[int | None, float | None]:
    """(step, test − control) at the last step both loss curves have; (None, None) without
    curves (a report written without them, or a pair that errored)."""
    curves = pair.get("curves") or {}
    control = (curves.get("control") or {}).get("loss")
    test = (curves.get("test") or {}).get("loss")
    if not control or not test:
        return None, None
    c = {int(s): _num(v) for s, v in zip(control["steps"], control["values"])}
    t = {int(s): _num(v) for s, v in zip(test["steps"], test["values"])}
    common = sorted(set(c) & set(t))
    if not common:
        return None, None
    step = common[-1]
    a, b = c[step], t[step]
    return step, (None if a is None or b is None else b - a)


def _resource(pair: Mapping[str, Any], metric: str) -> dict[str, float | str | None]:
    entry = (pair.get("resources") or {}).get(metric) or {}
    return {k: _json_num(_num(entry.get(k))) for k in ("control", "test", "ratio")}


def history_records(report: Mapping[str, Any], *, night: str,
                    pytest_status: int | None = None) -> list[dict[str, Any]]:
    """One history record per pair of a report.json document."""
    env = report.get("environment") or {}
    records = []
    for pair in report.get("pairs", []):
        step, delta = final_loss_delta(pair)
        records.append({
            "history_version": HISTORY_VERSION,
            "night": night,
            "generated_at": report.get("generated_at"),
            "slurm_job_id": env.get("slurm_job_id") or os.environ.get("SLURM_JOB_ID"),
            "pytest_status": pytest_status,
            "pair": pair["id"],
            "status": pair["status"],
            "verdicts": {v["metric"]: bool(v["passed"]) for v in pair.get("verdicts", [])},
            "final_step": step,
            "final_loss_delta": _json_num(delta),
            "max_abs_loss_delta": (pair.get("max_abs_delta") or {}).get("loss"),
            "tokens_per_s": _resource(pair, "tokens_per_s"),
            "peak_mem_mib": _resource(pair, "peak_mem_mib"),
            "wall_s": (pair.get("wall_s") or {}).get("pair"),
        })
    return records


def load_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"cannot read the report: {exc.strerror}", file=str(path),
                        fix="pass the report.json written by --convergence-report") from None
    except ValueError as exc:
        raise SpecError(f"not JSON: {exc}", file=str(path),
                        fix="pass the report.json written by --convergence-report") from None
    if not isinstance(data, dict) or not isinstance(data.get("pairs"), list):
        raise SpecError("not a pytest-convergence report (no 'pairs' list)", file=str(path),
                        key="pairs", fix="pass the report.json written by --convergence-report")
    return data


def append_history(report_path: Path, history: Path, *, night: str,
                   pytest_status: int | None = None) -> list[dict[str, Any]]:
    """Append the night's records to ``history`` (created with its folder if needed)."""
    records = history_records(load_report(report_path), night=night,
                              pytest_status=pytest_status)
    history.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    with open(history, "a", encoding="utf-8") as fh:
        fh.write(text)
    return records


@dataclass(frozen=True, kw_only=True)
class History:
    records: tuple[dict[str, Any], ...]
    skipped_lines: int = 0
    """Lines that were not a JSON object (e.g. a night killed while writing)."""

    def nights(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.records:
            seen.setdefault(str(r["night"]), None)
        return list(seen)

    def by_pair(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            out.setdefault(str(r["pair"]), []).append(r)
        return out


def read_history(path: Path) -> History:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpecError(f"cannot read the history: {exc.strerror}", file=str(path),
                        fix="pass the history.jsonl that `convergence record` appends to"
                        ) from None
    records, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and "pair" in record and "night" in record:
            records.append(record)
        else:
            skipped += 1
    if not records:
        raise SpecError("no history records in it", file=str(path),
                        fix="run a night first (sbatch the script from `convergence nightly`)")
    return History(records=tuple(records), skipped_lines=skipped)


# -- the trend report -----------------------------------------------------------------------

def _value(record: Mapping[str, Any], metric: str) -> float | None:
    value = record.get(metric)
    if isinstance(value, dict):
        value = value.get("test")
    return _num(value)


@dataclass(frozen=True, kw_only=True)
class TrendFiles:
    markdown: Path
    json: Path
    png: Path
    series: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    """pair -> metric -> value per night (None where the pair did not run)."""


def trend_series(history: History) -> tuple[list[str], dict[str, dict[str, list[float | None]]]]:
    nights = history.nights()
    index = {n: i for i, n in enumerate(nights)}
    series: dict[str, dict[str, list[float | None]]] = {}
    for pair, records in history.by_pair().items():
        per_metric: dict[str, list[float | None]] = {m: [None] * len(nights)
                                                     for m, _ in TREND_METRICS}
        for r in records:
            for metric, _ in TREND_METRICS:
                per_metric[metric][index[str(r["night"])]] = _value(r, metric)
        series[pair] = per_metric
    return nights, series


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def render_trend_markdown(history: History) -> str:
    nights = history.nights()
    lines = [f"# Convergence trend ({len(nights)} nights: {nights[0]} … {nights[-1]})", ""]
    if history.skipped_lines:
        lines += [f"{history.skipped_lines} unreadable history line(s) skipped.", ""]
    lines += ["![trend](trend.png)", ""]
    for pair, records in sorted(history.by_pair().items()):
        lines += [f"## {pair}", "",
                  "| night | verdict | final loss Δ | tokens/s (test) | tokens/s ratio "
                  "| peak MiB (test) |", "|---|---|---|---|---|---|"]
        for r in records:
            tps, mem = r.get("tokens_per_s") or {}, r.get("peak_mem_mib") or {}
            lines.append(f"| {r['night']} | {r['status']} | "
                         f"{_fmt(_num(r.get('final_loss_delta')))} | "
                         f"{_fmt(_num(tps.get('test')))} | {_fmt(_num(tps.get('ratio')))} | "
                         f"{_fmt(_num(mem.get('test')))} |")
        lines.append("")
    return "\n".join(lines)


def plot_trend(nights: Sequence[str], series: Mapping[str, Mapping[str, list[float | None]]],
               path: Path) -> Path:
    """One panel per metric, one line per pair, nights on the x axis (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TREND_METRICS), 1, sharex=True,
                             figsize=(max(6.0, 0.9 * len(nights) + 3), 2.6 * len(TREND_METRICS)))
    x = list(range(len(nights)))
    try:
        for ax, (metric, label) in zip(axes, TREND_METRICS):
            for pair, per_metric in sorted(series.items()):
                ys = [math.nan if v is None else v for v in per_metric[metric]]
                ax.plot(x, ys, marker="o", label=pair)
            if metric == "final_loss_delta":
                ax.axhline(0.0, color="0.6", linewidth=0.8)
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7, loc="best")
        axes[-1].set_xticks(x)
        axes[-1].set_xticklabels(nights, rotation=30, ha="right", fontsize=7)
        fig.suptitle("pytest-convergence: nightly trend")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def write_trend(history_path: Path, out: Path) -> TrendFiles:
    history = read_history(history_path)
    nights, series = trend_series(history)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "trend.md"
    md.write_text(render_trend_markdown(history), encoding="utf-8")
    js = out / "trend.json"
    js.write_text(json.dumps({"nights": nights, "pairs": {
        p: {m: [_json_num(v) for v in vs] for m, vs in per.items()} for p, per in series.items()
    }, "skipped_lines": history.skipped_lines}, indent=2), encoding="utf-8")
    png = plot_trend(nights, series, out / "trend.png")
    return TrendFiles(markdown=md, json=js, png=png, series=series)


# -- command line (wired into convergence.cli by add_subcommands) --------------------------

def cmd_nightly(args: argparse.Namespace) -> int:
    out = Path(args.out)
    settings = NightlySettings(
        experiments=tuple(args.experiments), out=str(out.resolve()),
        rootdir=str(Path(args.rootdir).resolve()), history=args.history,
        nodes=args.nodes, time=args.time, partition=args.partition,
        gpus_per_node=args.gpus_per_node, exclusive=not args.no_exclusive,
        sbatch_options=tuple(args.sbatch_option or ()),
        pytest_args=tuple(shlex.split(args.pytest_args or "")))
    if args.stdout:
        print(render_sbatch(settings))
        return 0
    script = write_sbatch(settings, Path(args.script) if args.script else out / "nightly.sbatch")
    print(f"sbatch script written to {script}")
    if args.submit:
        done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
        print((done.stdout or done.stderr).strip())
        return 0 if done.returncode == 0 else 1
    print(f"submit it with: sbatch {script}")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    night = args.night or dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    records = append_history(Path(args.report), Path(args.history), night=night,
                             pytest_status=args.pytest_status)
    print(f"{len(records)} pair(s) of night {night} appended to {args.history}")
    return 0


def cmd_trend(args: argparse.Namespace) -> int:
    files = write_trend(Path(args.history), Path(args.out))
    for path in (files.markdown, files.json, files.png):
        print(f"  {path}")
    return 0


def add_subcommands(sub: Any) -> None:
    """Register ``nightly``, ``record`` and ``trend`` on the CLI's subparsers."""
    nightly = sub.add_parser("nightly", help="write (or submit) the nightly sbatch script")
    nightly.add_argument("--experiments", nargs="+", required=True, metavar="PATH",
                         help="experiment TOML files or folders (pytest arguments)")
    nightly.add_argument("--out", required=True, metavar="DIR",
                         help="folder for nights, Slurm output and history.jsonl")
    nightly.add_argument("--history", help="history file (default OUT/history.jsonl)")
    nightly.add_argument("--rootdir", default=".", help="where pytest runs (default: here)")
    nightly.add_argument("--script", help="where to write the script (default "
                                          "OUT/nightly.sbatch)")
    nightly.add_argument("--stdout", action="store_true", help="print the script instead")
    nightly.add_argument("--submit", action="store_true", help="sbatch it right away")
    nightly.add_argument("--nodes", type=int, default=1)
    nightly.add_argument("--time", default="08:00:00", help="Slurm time limit")
    nightly.add_argument("--partition")
    nightly.add_argument("--gpus-per-node", type=int)
    nightly.add_argument("--no-exclusive", action="store_true",
                         help="share nodes with other jobs (default: --exclusive)")
    nightly.add_argument("--sbatch-option", action="append", metavar="OPT",
                         help="extra #SBATCH option, e.g. --account=ml (repeatable)")
    nightly.add_argument("--pytest-args", help="extra pytest arguments (one string)")
    nightly.set_defaults(func=cmd_nightly)

    record = sub.add_parser("record", help="append a report.json's pairs to a history file")
    record.add_argument("report", help="report.json")
    record.add_argument("history", help="history JSONL file (appended to)")
    record.add_argument("--night", help="night name (default: UTC time stamp)")
    record.add_argument("--pytest-status", type=int, help="pytest's exit status that night")
    record.set_defaults(func=cmd_record)

    trend = sub.add_parser("trend", help="trend report across nights (markdown + PNG)")
    trend.add_argument("history", help="history JSONL file")
    trend.add_argument("--out", required=True, metavar="DIR", help="report folder")
    trend.set_defaults(func=cmd_trend)

"""What ``--convergence-report`` costs, per format and per pair (issue 30).

Each round is a fresh Python process (so the imports are counted as a session pays them) that
writes the report of the test suite's example outcomes (tests/report_examples.py: passing,
failing, errored, seed-regime pairs) phase by phase: importing the report package, importing
matplotlib, each pair's plot, the heatmap, report.json's data, report.json/.md/.html; then
``write_reports`` as a whole into a second folder. Wall and CPU seconds of that process.

    python benchmarks/report_cost.py [--rounds 3] [--no-append]

Prints the median and the range over the rounds, and writes its section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import machine, write_section

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
out = {}
def mark(name, start):
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    out[name] = [wall, cpu]
def now():
    return (time.perf_counter(), time.process_time())
from report_examples import all_examples
outcomes = all_examples()
t = now(); import convergence.report; mark("import convergence.report", t)
from convergence.report import write_reports
from convergence.report.data.schema import build_report
from convergence.report.formats import plots
from convergence.report.formats.html import render_html
from convergence.report.formats.markdown import render_markdown
t = now()
import matplotlib.figure, matplotlib.backends.backend_agg
mark("import matplotlib (Agg)", t)
tmp = Path(tempfile.mkdtemp(prefix="report-cost-"))
pair_times = []
for i, o in enumerate(outcomes):
    t = now(); plots.plot_pair(o, tmp / f"{i}.png"); pair_times.append(now())
    out[f"plot: {o.pair.name} ({o.status})"] = [pair_times[-1][0] - t[0], pair_times[-1][1] - t[1]]
t = now(); plots.plot_heatmap(outcomes, tmp / "heatmap.png"); mark("heatmap", t)
t = now()
report = build_report(outcomes, environment={}, started_at=None, wall_s=None, plots={},
                      plot_errors={}, report_dir=tmp)
mark("report data (build_report)", t)
t = now(); json.dumps(report, indent=1, allow_nan=False); mark("report.json", t)
t = now(); render_markdown(report); mark("report.md", t)
files = {f"plots/{p.name}": p for p in tmp.glob("*.png")}
t = now(); render_html(report, files); mark("report.html (plots embedded)", t)
t = now()
write_reports(outcomes, tmp / "whole", environment={}, started_at=None, wall_s=None)
mark("write_reports, all files (warm)", t)
out["pairs"] = len(outcomes)
import shutil; shutil.rmtree(tmp, ignore_errors=True)
print("RESULT=" + json.dumps(out))
"""


def one_round() -> dict[str, list[float]]:
    """One fresh process: {phase: [wall s, CPU s]} and "pairs" (their number)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO / "tests")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT=")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(proc.stdout + proc.stderr)
    result: dict[str, list[float]] = json.loads(line.removeprefix("RESULT="))
    return result


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(rounds: list[dict[str, list[float]]]) -> str:
    pairs = int(rounds[0]["pairs"])  # type: ignore[arg-type]
    rows = ["| phase | wall s, median (range) | CPU s, median (range) |", "|---|---:|---:|"]
    for name in (n for n in rounds[0] if n != "pairs"):
        rows.append(
            f"| {name} | {_cell([r[name][0] for r in rounds])} | "
            f"{_cell([r[name][1] for r in rounds])} |"
        )
    per_pair = [
        [sum(v[k] for n, v in r.items() if n.startswith("plot: ")) / pairs for r in rounds]
        for k in (0, 1)
    ]
    rows.append(
        f"| **per pair** (its plot; the documents are shared) | {_cell(per_pair[0])} | "
        f"{_cell(per_pair[1])} |"
    )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-append", action="store_true", help="do not write BENCHMARKS.md")
    args = p.parse_args()
    load_before = os.getloadavg()
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round())
        print(f"round {i + 1} done", flush=True)
    load_after = os.getloadavg()
    text = table(rounds)
    print(text)
    if args.no_append:
        return
    section = (
        f"## Report cost per format and per pair ({time.strftime('%Y-%m-%d')}, "
        f"benchmarks/report_cost.py)\n\n"
        f"`python benchmarks/report_cost.py --rounds {args.rounds}`: the report of the four "
        f"example outcomes of tests/report_examples.py, phase by phase, each round a fresh "
        f"process (imports counted as a session pays them).\n\n"
        f"Machine: {machine()}. Load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.1f}' for x in load_after)} after.\n\n{text}\n"
    )
    write_section("report-cost", section)
    print(f"wrote the report-cost section of {REPO / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    main()

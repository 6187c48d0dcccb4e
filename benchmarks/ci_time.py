"""How long CI takes: reads `.ci/run` logs and writes the 'CI time' table of BENCHMARKS.md.

    python benchmarks/ci_time.py "idle=ci-idle.log" "beside a 2nd suite=a.log" --note "..."

Each log is the full output of `CI=true bash .ci/run` (with `time` around it or not). The
phases come from the `== <phase> took N s` lines that `.ci/run` prints; the outcome and the
tests' wall time from pytest's closing line; the slowest tests from `--durations`. The machine
and what else ran on it are not in a log: say so with --note (e.g. "2 cores, idle").
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import write_section

PHASE = re.compile(r"^== (?P<name>.+?) took (?P<s>\d+) s \(total (?P<total>\d+) s\)$")
CLOSING = re.compile(
    r"^=*\s*(?P<summary>(\d+ (passed|failed|skipped|errors?|deselected|"
    r"warnings?)(, )?)+) in (?P<s>[\d.]+)s"
)
DURATION = re.compile(r"^(?P<s>[\d.]+)s (call|setup|teardown)\s+(?P<test>\S+)$")


STARTS = re.compile(r"^== (?P<name>.+)$")


def parse(log: Path) -> dict[str, object]:
    phases: dict[str, int] = {}
    summary, tests_s, slowest = "no closing line", float("nan"), []
    draws: list[str] = []  # the closing lines of the rounding-draw phases
    total, phase = 0, ""
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if m := PHASE.match(line):
            phases[m["name"]] = int(m["s"])
            total = int(m["total"])
        elif m := STARTS.match(line):
            phase = m["name"]
        elif m := CLOSING.match(line):
            # The suite's own closing line is the tests phase's; the phases after it run the
            # rounding-sensitive tests under other draws.
            if phase.startswith("rounding draw"):
                draws.append(f"{phase.split(' (')[0]}: {m['summary']}")
            elif phase == "tests":
                summary, tests_s = m["summary"], float(m["s"])
        elif m := DURATION.match(line):
            slowest.append((float(m["s"]), m["test"]))
    return {
        "phases": phases,
        "summary": summary,
        "tests_s": tests_s,
        "total_s": total,
        "slowest": sorted(slowest, reverse=True)[:5],
        "draws": draws,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=LOG: a label and a .ci/run log")
    ap.add_argument("--note", default="", help="the machine and its load, in words")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    rows = []
    for run in args.runs:
        label, _, path = run.partition("=")
        rows.append((label, parse(Path(path))))
    lines = [
        "| run | install | lint | tests | rounding draws | whole `.ci/run` | outcome |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in rows:
        ph = r["phases"]
        assert isinstance(ph, dict)
        install = sum(v for k, v in ph.items() if k.startswith("install"))
        tests_min = ph.get("tests", 0) / 60
        draws_min = sum(v for k, v in ph.items() if k.startswith("rounding draw")) / 60
        draws = r["draws"]
        assert isinstance(draws, list)
        outcome = "; ".join([str(r["summary"]), *draws])
        lines.append(
            f"| {label} | {install / 60:.1f} min | {ph.get('lint', 0)} s | "
            f"{tests_min:.1f} min | {draws_min:.1f} min | {int(r['total_s']) / 60:.1f} min "
            f"| {outcome} |"
        )
    slow = ["", "Slowest tests of the first run (`--durations`):", ""]
    first = rows[0][1]["slowest"]
    assert isinstance(first, list)
    slow += [f"- {s:.0f} s `{t}`" for s, t in first]
    body = "\n".join(["## CI time (benchmarks/ci_time.py)", "", args.note, "", *lines, *slow])
    print(body)
    if not args.no_write:
        write_section("ci-time", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

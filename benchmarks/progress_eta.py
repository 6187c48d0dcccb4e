"""How right the progress ETA is: each progress line of a ``convergence run`` timestamped,
its ETA set against the time the job really took to log its last step.

    python benchmarks/progress_eta.py [EXPERIMENT]     # default: experiments/quickstart.toml

Prints, per job, step | ETA shown | real time left | ETA / real. Nothing is asserted (the
numbers depend on the machine): the result goes to BENCHMARKS.md ("Progress ETA").
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"\[(.+?)\] step (\d+)/(\d+).*?(?: ETA (?:(\d+):)?(\d+):(\d+))?$")


def eta_seconds(match: re.Match[str]) -> int | None:
    if match.group(6) is None:
        return None
    hours = int(match.group(4) or 0)
    return hours * 3600 + int(match.group(5)) * 60 + int(match.group(6))


def main() -> int:
    experiment = sys.argv[1] if len(sys.argv) > 1 else str(REPO / "experiments/quickstart.toml")
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "convergence.cli", "run", experiment],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    assert proc.stderr is not None
    lines = [(time.monotonic() - start, line.rstrip()) for line in proc.stderr]
    proc.wait()
    jobs: dict[str, list[tuple[float, int, int, int | None]]] = {}
    for at, line in lines:
        match = LINE.match(line)
        if match:
            jobs.setdefault(match.group(1), []).append(
                (at, int(match.group(2)), int(match.group(3)), eta_seconds(match))
            )
    for name, rows in jobs.items():
        ends = [at for at, step, total, _ in rows if step == total]
        if not ends:
            continue
        print(f"{name}\n  step | ETA (s) | real left (s) | ETA / real")
        for at, step, total, eta in rows:
            left = ends[0] - at
            ratio = f"{eta / left:.2f}" if eta is not None and left > 0.5 else "-"
            print(
                f"  {step:>4}/{total} | {'-' if eta is None else eta:>7} | {left:>13.1f} | {ratio}"
            )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

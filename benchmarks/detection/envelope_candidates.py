"""Envelope constructions compared offline on the saved twin-regime curves (issue 28).

No training: every construction is recomputed from the curves envelope_configs.py saved
(benchmarks/detection/envelope/curves/*.json.gz: the control, each twin -- noise twin, forward-noise
twin, the twin with the test's numerics -- and the test, 60 steps, early stopping off). Per
construction: false alarms among the correct pairs, planted bugs caught and caught by step 15
(the first quarter of 60), their first failing steps, the worst correct pair's ratio, and the
window of k in which the construction gives 0 false alarms *and* every bug in the first quarter
(how much room the chosen k has on either side). The k is the shipped 3 for every row: a
construction is judged as it would ship, not with a k tuned for it.

Curves whose file name matches ``--holdout`` (default ``-9``: seed 9 of configs B and C, collected
after the construction was chosen) are judged apart, without retuning.

    python benchmarks/detection/envelope_candidates.py              # writes BENCHMARKS.md
    python benchmarks/detection/envelope_candidates.py --no-write
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _report

from _report import machine, write_section

from convergence.metrics.curve import Curve
from convergence.stats.twin_envelope import TWIN_DEFAULTS, twin_noise

HERE = Path(__file__).resolve().parent
CURVES = HERE / "envelope" / "curves"
METRICS = ("loss", "grad_norm", "grad_norm_parts")
QUARTER = 15  # of 60 steps
Noise = Callable[[np.ndarray, Sequence[np.ndarray]], np.ndarray]


def _lead(running: np.ndarray, pool: int) -> np.ndarray:
    return running[np.minimum(np.arange(running.size) + pool, running.size - 1)]


def construction(combine: str, pool: int, pairs: bool = False) -> Noise:
    """The noise at each step from the control and its twins (all logged at steps 1..n).

    combine: how the twins' running maxima are put together -- "max" (the noisiest twin),
    "sum" (every twin's noise added), "rss" (root sum of squares); pairs: also the twins'
    gaps to each other (another draw of the noise from runs already made); pool: steps ahead
    whose gaps count at a step (TwinDefaults.pool).
    """

    def noise(control: np.ndarray, twins: Sequence[np.ndarray]) -> np.ndarray:
        gaps = [np.abs(t - control) for t in twins]
        if pairs:
            gaps += [np.abs(a - b) for a, b in itertools.combinations(twins, 2)]
        running = np.array([np.maximum.accumulate(np.where(np.isfinite(g), g, 0.0)) for g in gaps])
        if combine == "max":
            merged = running.max(axis=0)
        elif combine == "sum":
            merged = running.sum(axis=0)
        else:
            merged = np.sqrt(np.square(running).sum(axis=0))
        return _lead(merged, pool)

    return noise


def growth_floor(alpha: float, pool: int = 2) -> Noise:
    """The noisiest twin's running max, floored by every earlier level grown by
    (step/earlier)^alpha: a chaos growth model that lets the envelope keep growing after the
    twins' gaps stopped."""
    base = construction("max", pool)

    def noise(control: np.ndarray, twins: Sequence[np.ndarray]) -> np.ndarray:
        n = base(control, twins)
        s = np.arange(1, n.size + 1, dtype=np.float64)
        grown = n[None, :] * (s[:, None] / s[None, :]) ** alpha
        return np.max(np.where(s[None, :] <= s[:, None], grown, 0.0), axis=1)

    return noise


def library(control: np.ndarray, twins: Sequence[np.ndarray]) -> np.ndarray:
    """The construction convergence/stats/twin_envelope.py ships (its defaults' pool)."""
    steps = np.arange(1, control.size + 1, dtype=np.int64)
    as_curve = lambda v: Curve("loss", steps, v)
    _, noise = twin_noise(
        as_curve(control), [as_curve(t) for t in twins], pool=TWIN_DEFAULTS["loss"].pool
    )
    return noise


CANDIDATES: dict[str, tuple[Noise, str]] = {
    "max, pool 2 (before)": (construction("max", 2), "the noisiest twin's running max"),
    "max, pool 5": (construction("max", 5), "pool 5 steps ahead"),
    "max, pool 10": (construction("max", 10), "pool 10 steps ahead"),
    "max + twin-twin gaps, pool 2": (construction("max", 2, pairs=True), "a free extra draw"),
    "max + twin-twin gaps, pool 5": (construction("max", 5, pairs=True), ""),
    "max, growth floor sqrt(step)": (growth_floor(0.5), "chaos growth model, alpha 1/2"),
    "max, growth floor step^1": (growth_floor(1.0), "chaos growth model, alpha 1"),
    "rss, pool 2": (construction("rss", 2), "root sum of squares of the twins"),
    "sum, pool 1": (construction("sum", 1), ""),
    "sum, pool 2 (chosen, shipped)": (library, "every twin's noise added"),
}


READING = """What the tables say:

- The noisiest twin's running max (the envelope before) let 3 of 31 correct pairs out late
  (steps 40-43) and, on the hold-out, C's TP pair at step 46. The gap at one step is a
  heavy-tailed draw (on C every run's grad-norm gap jumps 10-100x together at a few steps), and
  one twin's draw can be ~5x below the layout's.
- Summing the twins' running maxima (each twin isolates one source of rounding -- reduction
  order, forward re-rounding, the test's precision -- and a TP layout carries several; to first
  order perturbations superpose) is the only construction tried with 0 false alarms on the
  development curves at the shipped k = 3 that also kept every bug by step 15; chosen there,
  it held on the hold-out: 0/12, every bug by step 13. Its worst hold-out pair (C, TP, grad
  norm at step 46) reached 0.997 of the envelope: a pass with no margin.
- The cost: the least visible bug (row-wise all-reduce left out) fails at steps 12-14 instead
  of 5-12.
- The limit, honestly: for every construction the window of k with 0 false alarms and every
  bug by step 15 is ~1.2-1.5x wide on these curves, and the noisiest twin at k ~ 5.3-6.4 would
  have done on the development curves what the sum does at 3. The sum is preferred because
  its factor comes from a reason (the number of noise sources a layout combines), not from
  these curves; that it held on the hold-out is one more data point, not proof of margin.
"""


def load(paths: Sequence[Path]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for path in paths:
        loaded = json.loads(gzip.decompress(path.read_bytes()))
        loaded.pop("_meta", None)
        data.update({name: case for name, case in loaded.items() if "error" not in case})
    return data


def judge(case: dict[str, Any], noise: Noise, k: float) -> tuple[int | None, float]:
    """(first failing step or None, worst ratio |Δ|/tolerance over metrics and steps), with
    the shipped floors (rtol x |control|; atol and growth are 0 for these metrics)."""
    first: int | None = None
    worst = 0.0
    for metric in METRICS:
        d = TWIN_DEFAULTS[metric]
        steps = np.asarray(case["control"][metric][0])
        control = np.asarray(case["control"][metric][1], dtype=np.float64)
        test = np.asarray(case["test"][metric][1], dtype=np.float64)
        twins = [np.asarray(t[metric][1], dtype=np.float64) for t in case["twins"]]
        floor = d.atol * (1.0 + d.growth * np.sqrt(steps)) + d.rtol * np.abs(control)
        tol = k * noise(control, twins) + floor
        gap = np.abs(test - control)
        with np.errstate(invalid="ignore", divide="ignore"):
            worst = max(worst, float(np.nanmax(np.where(np.isnan(gap), np.inf, gap / tol))))
        out = np.flatnonzero(~(gap <= tol))
        if out.size:
            step = int(steps[out[0]])
            first = step if first is None else min(first, step)
    return first, worst


def score(data: dict[str, Any], noise: Noise, k: float) -> dict[str, Any]:
    alarms, firsts, correct_worst = [], [], 0.0
    for name, case in data.items():
        first, worst = judge(case, noise, k)
        if case["kind"] == "correct":
            correct_worst = max(correct_worst, worst)
            if first is not None:
                alarms.append(f"{name}@{first}")
        else:
            firsts.append(first)
    return {
        "correct": sum(c["kind"] == "correct" for c in data.values()),
        "alarms": alarms,
        "bugs": len(firsts),
        "caught": sum(f is not None for f in firsts),
        "quarter": sum(f is not None and f <= QUARTER for f in firsts),
        "firsts": sorted(f for f in firsts if f is not None and f > 1),
        "worst": correct_worst,
    }


def k_window(data: dict[str, Any], noise: Noise) -> tuple[float | None, float | None]:
    """(smallest k with 0 false alarms, largest k with every bug by step 15) on a 2% grid."""
    low = high = None
    for k in np.exp(np.arange(np.log(1.0), np.log(10.0), 0.02)):
        s = score(data, noise, float(k))
        if not s["alarms"] and low is None:
            low = float(k)
        if s["quarter"] == s["bugs"]:
            high = float(k)
    return low, high


def table(data: dict[str, Any], k: float, window: bool) -> str:
    head = "| construction | false alarms | bugs caught | by step 15 | first steps > 1 | "
    head += "worst correct ratio |" + (" k window (0 FA .. all bugs by 15) |" if window else "")
    lines = [head, "|---|---:|---:|---:|---|---:|" + ("---|" if window else "")]
    for name, (noise, _) in CANDIDATES.items():
        s = score(data, noise, k)
        row = (
            f"| {name} | {len(s['alarms'])}/{s['correct']} | {s['caught']}/{s['bugs']} | "
            f"{s['quarter']} | {', '.join(map(str, s['firsts'])) or '-'} | {s['worst']:.2f} |"
        )
        if window:
            low, high = k_window(data, noise)
            row += (
                f" {low:.2f} .. {high:.2f} |"
                if low is not None and high is not None and low <= high
                else f" none ({low and f'{low:.2f}'} .. {high and f'{high:.2f}'}) |"
            )
        lines.append(row)
    return "\n".join(lines)


def alarms(data: dict[str, Any], k: float) -> str:
    out = []
    for name, (noise, _) in CANDIDATES.items():
        found = score(data, noise, k)["alarms"]
        if found:
            out.append(f"- {name}: {', '.join(found)}")
    return "\n".join(out) or "- none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", type=Path, nargs="*")
    parser.add_argument("--holdout", default="-9", help="file names with this are the hold-out")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    paths = args.curves or sorted(CURVES.glob("*.json.gz"))
    held = [p for p in paths if args.holdout and args.holdout in p.name]
    dev = load([p for p in paths if p not in held])
    k = TWIN_DEFAULTS["loss"].k
    parts = [
        "## Twin envelope constructions (benchmarks/detection/envelope_candidates.py)",
        f"Machine: {machine()} (offline: no training, the saved curves of "
        '"Twin envelope on other models" recomputed). Every construction at the shipped '
        f"k = {k:g} with the shipped rtol floors; a bug counts in the first quarter when it "
        f"fails by step {QUARTER} of 60.",
        f"Development curves ({', '.join(p.name for p in paths if p not in held)}): "
        f"{len(dev)} pairs.",
        table(dev, k, window=True),
        "False alarms by construction:\n\n" + alarms(dev, k),
    ]
    if held:
        hold = load(held)
        parts += [
            f"Hold-out ({', '.join(p.name for p in held)}: collected after the construction "
            f"was chosen, judged without retuning): {len(hold)} pairs.",
            table(hold, k, window=False),
            "False alarms by construction (hold-out):\n\n" + alarms(hold, k),
        ]
    parts.append(READING)
    body = "\n\n".join(parts)
    print(body)
    if not args.no_write:
        write_section("twin-envelope-candidates", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Seed band + TOST: false-alarm rate and detection power on simulated ensembles.

Each case draws K control replicates and one test run from the noise model in
``tests/simulate.py`` (a decaying loss, a slow AR(1) seed wander and fast batch
noise), shifts the test by ``shift`` x sigma_step from step 1, and asks the ``seed`` verdict
with default parameters (z 3, alpha 0.05, window 20). A shift of 0 measures false alarms (should
be <= alpha); a shift > 0 measures power. A second model where the slow seed wander dominates
checks that the false-alarm rate holds when neighbouring steps are strongly correlated.

    python benchmarks/stats_false_alarm.py [--cases 200] [--seed 0] [--no-write]

Prints the tables and writes its section of BENCHMARKS.md (replacing an earlier run's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The noise model is a test helper (tests/simulate.py): the tests and this benchmark share it,
# the library does not ship it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np
from _report import machine, write_section
from simulate import NoiseModel, simulate_case

from convergence.spec.pair import ComparisonRule
from convergence.stats.seed_band import SeedBand

REPO = Path(__file__).resolve().parents[1]
REPLICATES = (3, 5, 8)
SHIFTS = (0.0, 1.0, 2.0, 3.0, 4.0)
MODELS = {
    "base (slow σ 0.02, φ 0.95; fast σ 0.03)": NoiseModel(),
    "slow-dominated (slow σ 0.05, φ 0.95; fast σ 0.01)": NoiseModel(
        sigma_slow=0.05, sigma_fast=0.01
    ),
}


def failure_rate(
    model: NoiseModel, num_replicates: int, shift: float, cases: int, rng: np.random.Generator
) -> float:
    rule = ComparisonRule(metric="loss", method="seed")
    fails = 0
    for _ in range(cases):
        controls, test = simulate_case(rng, model, num_replicates, shift=shift * model.sigma_step)
        fails += not SeedBand().compare(rule, controls, test).passed
    return fails / cases


def table(
    model: NoiseModel, shifts: tuple[float, ...], cases: int, rng: np.random.Generator
) -> list[str]:
    header = "| K | " + " | ".join(f"shift {s:g}σ" for s in shifts) + " |"
    lines = [header, "|---|" + "---|" * len(shifts)]
    for k in REPLICATES:
        # Power is cheap to pin down (rates near 1); false alarms need more cases.
        rates = [
            failure_rate(model, k, s, cases if s == 0 else max(cases // 2, 20), rng) for s in shifts
        ]
        lines.append(f"| {k} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="null cases per K (power: half)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    sections: list[str] = []
    for i, (name, model) in enumerate(MODELS.items()):
        shifts = SHIFTS if i == 0 else (0.0, 2.0, 4.0)
        sections += [
            f"Model: {name}, {model.num_steps} steps. Failure rate of the verdict "
            f"(shift 0 = false alarms; else power):",
            "",
            *table(model, shifts, args.cases, rng),
            "",
        ]
    elapsed = time.perf_counter() - started
    text = "\n".join(sections)
    print(text)
    print(f"({elapsed:.1f} s)")
    if not args.no_write:
        write_report(text, elapsed, args.cases)


def write_report(text: str, elapsed: float, cases: int) -> None:
    section = "\n".join(
        [
            "## Seed band: false alarms and power (benchmarks/stats_false_alarm.py)",
            "",
            f"Machine: {machine()}. {cases} null cases per K, {cases // 2} per shift; α = 0.05, "
            f"z = 3, window 20; σ = one run's per-step std. Took {elapsed:.1f} s.",
            "",
            text.rstrip(),
            "",
            "Reading: false alarms stay near or below α = 0.05 (the sampling error of 200 cases "
            "is ±0.015; the TOST's derived margin spends α/2, the band most of the rest), also "
            "when the slow seed wander dominates. A sustained 3σ shift is found almost always; "
            "2σ most of the time for K ≥ 5. Smaller shifts need more replicates or an explicit "
            "`margin`.",
        ]
    )
    write_section("stats_false_alarm", section)


if __name__ == "__main__":
    main()

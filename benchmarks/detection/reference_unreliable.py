"""Control health's "reference unreliable" signs (convergence/stats/health.py unreliable_from)
re-judged offline on every saved twin-regime pair (benchmarks/detection/envelope/): for each,
today's twin verdict (its first failing step per metric), the step each sign fires at, and
what the pair becomes: pass, FAIL, or UNRELIABLE (an error: it failed only from that step on).

    python benchmarks/detection/reference_unreliable.py
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from convergence.metrics.curve import Curve
from convergence.spec.pair import ComparisonRule
from convergence.stats.health import unreliable_from, unreliable_reference
from convergence.stats.twin_envelope import TwinEnvelope

HERE = Path(__file__).resolve().parent
FILES = sorted((HERE / "envelope" / "long").glob("*.json.gz")) + sorted(
    (HERE / "envelope" / "curves").glob("*.json.gz")
)
METRICS = ("loss", "grad_norm", "grad_norm_parts")


def curve(metric: str, run: dict[str, Any]) -> Curve:
    steps, values = run[metric]
    return Curve(metric, np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=float))


def judge(case: dict[str, Any]) -> tuple[str, dict[str, int | None], int | None]:
    verdicts = [
        TwinEnvelope().compare(
            ComparisonRule(metric=m, method="twin"),
            [curve(m, case["control"]), *(curve(m, t) for t in case["twins"])],
            curve(m, case["test"]),
        )
        for m in METRICS
        if m in case["test"]
    ]
    fails = {v.metric: v.first_divergent_step for v in verdicts if not v.passed}
    found = unreliable_from(
        curve("grad_norm", case["control"]), [curve("grad_norm", t) for t in case["twins"]]
    )
    if not fails:
        return "pass", fails, found[0] if found else None
    outcome = "UNRELIABLE" if unreliable_reference(verdicts, found) else "FAIL"
    return outcome, fails, found[0] if found else None


def main() -> None:
    tally: Counter[tuple[str, str]] = Counter()
    for path in FILES:
        data = json.loads(gzip.decompress(path.read_bytes()))
        data.pop("_meta", None)
        for name, case in data.items():
            if not isinstance(case, dict) or not case.get("twins") or "error" in case:
                continue
            outcome, fails, step = judge(case)
            tally[(case["kind"], outcome)] += 1
            steps = len(case["control"]["loss"][0])
            if step is not None or outcome == "UNRELIABLE":
                print(
                    f"{path.name:24s} {name:42s} {case['kind']:7s} {steps:4d} steps "
                    f"fails {fails} unreliable from {step} -> {outcome}"
                )
    for (kind, outcome), count in sorted(tally.items()):
        print(f"{kind:8s} {outcome:10s} {count}")


if __name__ == "__main__":
    main()

"""Calibrate the twin regime's defaults on CPU bf16: what multiple k of the measured noise each
correct layout needs (must stay below the default) and each planted bug reaches (must exceed it).

Runs the detection catalogue in bf16 (FSDP2 mixed precision on both sides) with early stopping
off, so every curve is whole, and the twin of each control group (the backend's
noise_twin). For every case and gating metric it prints

    needed k = max over steps of (|test - control| - floor(step)) / noise(step)

with noise(step) the running max of |twin - control| and floor the default's; a correct pair
passes with the default k when its needed k is below it, a bug is caught when above. The curves
are saved (``--save FILE``, JSON) so other defaults can be tried without rerunning
(``--load FILE``).

    python benchmarks/detection/twin_calibration.py --save /tmp/twin.json
    python benchmarks/detection/twin_calibration.py --load /tmp/twin.json --no-write
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # catalogue, pairs, run
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _report

from _report import machine, write_section
from catalogue import ALL
from run import as_bf16, has_fsdp, run_cases

from convergence.metrics.curve import Curve
from convergence.stats.twin_envelope import TWIN_DEFAULTS, twin_noise

METRICS = ("loss", "grad_norm", "grad_norm_parts")
Curves = dict[str, dict[str, list[list[float]]]]


def _curves(run: Any) -> dict[str, list[list[float]]]:
    return {m: [c.steps.tolist(), c.values.tolist()] for m, c in run.items() if m in METRICS}


def collect(steps: int, seeds_extra: bool) -> dict[str, Any]:
    cases = [as_bf16(c) for c in ALL if has_fsdp(c)]
    if not seeds_extra:
        cases = [c for c in cases if c.seed == 7]
    with tempfile.TemporaryDirectory(prefix="twin-cal-") as tmp:
        rows = run_cases(cases, steps=steps, early_stop=False, work=Path(tmp))
    out: dict[str, Any] = {}
    for row in rows:
        outcome = row.outcome
        if outcome.control is None or outcome.test is None:
            out[row.case.name] = {"kind": row.case.kind, "error": outcome.error}
            continue
        control = outcome.control.metrics
        twin = outcome.control.twins[0] if outcome.control.twins else {}
        out[row.case.name] = {
            "kind": row.case.kind,
            "layout": row.case.parallelism,
            "seed": row.case.seed,
            "status": outcome.status,
            "control": _curves(control),
            "twin": _curves(twin),
            "test": _curves(outcome.test.metrics),
        }
    return out


def needed_k(control: Curve, twin: Curve, test: Curve) -> tuple[float, float, float]:
    """(needed k, |d| at step 1, |d|/|control| at step 1)."""
    base = TWIN_DEFAULTS[control.metric]
    steps, noise = twin_noise(control, [twin], pool=base.pool)
    common, ci, ti = np.intersect1d(control.steps, test.steps, return_indices=True)
    d = np.abs(test.values[ti] - control.values[ci])
    floor = base.atol * (1 + base.growth * np.sqrt(common)) + base.rtol * np.abs(control.values[ci])
    index = np.clip(np.searchsorted(steps, common, side="right") - 1, 0, None)
    measured = noise[index]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(d <= floor, 0.0, (d - floor) / measured)
    return float(np.nanmax(ratio)), float(d[0]), float(d[0] / abs(control.values[ci][0]))


def table(data: dict[str, Any]) -> tuple[str, dict[str, int]]:
    lines = [
        "| case | kind | seed | "
        + " | ".join(f"{m}: needed k" for m in METRICS)
        + " | loss |d| step 1 | grad norm |d|/g step 1 | verdict at default k |",
        "|---|---|---:|" + "---:|" * len(METRICS) + "---:|---:|---|",
    ]
    counts: dict[str, Any] = {
        "bug": 0,
        "caught": 0,
        "correct": 0,
        "false_alarm": 0,
        "worst_correct": {m: 0.0 for m in METRICS},
        "weakest_bug": [],
    }
    for name, case in data.items():
        if "error" in case:
            lines.append(f"| {name} | {case['kind']} | | error: {case['error']} |")
            continue
        ks, loss1, gn1 = [], float("nan"), float("nan")
        failed = False
        best = 0.0
        for metric in METRICS:
            if metric not in case["test"] or metric not in case["twin"]:
                ks.append("-")
                continue
            control, twin, test = (
                Curve(
                    metric,
                    np.asarray(case[s][metric][0], np.int64),
                    np.asarray(case[s][metric][1], np.float64),
                )
                for s in ("control", "twin", "test")
            )
            k, d1, rel1 = needed_k(control, twin, test)
            failed |= k > TWIN_DEFAULTS[metric].k
            best = max(best, k)
            if case["kind"] == "correct":
                worst = counts["worst_correct"]
                worst[metric] = max(worst[metric], k)
            ks.append("inf" if not np.isfinite(k) else f"{k:.2g}")
            if metric == "loss":
                loss1 = d1
            if metric == "grad_norm":
                gn1 = rel1
        kind = case["kind"]
        counts[kind] += 1
        if kind == "bug":
            counts["weakest_bug"].append((best, name))
        if kind == "bug":
            counts["caught"] += failed
        else:
            counts["false_alarm"] += failed
        verdict = (
            ("caught" if failed else "**missed**")
            if kind == "bug"
            else ("**false alarm**" if failed else "pass")
        )
        lines.append(
            f"| {name} | {kind} | {case['seed']} | "
            + " | ".join(ks)
            + f" | {loss1:.2g} | {gn1:.2g} | {verdict} |"
        )
    return "\n".join(lines), counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument(
        "--all-seeds",
        action="store_true",
        help="also the catalogue's other-seed cases (control per seed)",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    start = time.monotonic()
    if args.load:
        data = json.loads(args.load.read_text())
    else:
        data = collect(args.steps, args.all_seeds)
        data["_meta"] = {"collect_min": (time.monotonic() - start) / 60, "machine": machine()}
        if args.save:
            args.save.write_text(json.dumps(data))
    meta = data.pop("_meta", {"collect_min": float("nan"), "machine": machine()})
    text, counts = table(data)
    defaults = ", ".join(
        f"{m}: k {TWIN_DEFAULTS[m].k:g}, atol {TWIN_DEFAULTS[m].atol:g}, "
        f"rtol {TWIN_DEFAULTS[m].rtol:g}"
        for m in METRICS
    )
    body = "\n\n".join(
        (
            "## Twin regime calibration, CPU bf16 (benchmarks/detection/twin_calibration.py)",
            f"Machine: {meta['machine']}. `python benchmarks/detection/twin_calibration.py"
            f"{' --all-seeds' if args.all_seeds else ''}`: the detection catalogue with bf16 params "
            f"on both sides (FSDP2 mixed precision), debug model, {args.steps} steps, early "
            "stopping off; control FSDP(2), twin FSDP(4) with half the local batch. Needed k: "
            "max over steps of (|test - control| - floor) / running max |twin - control|. "
            f"Defaults: {defaults}.",
            f"Caught **{counts['caught']}/{counts['bug']}** planted bugs; false alarms "
            f"**{counts['false_alarm']}/{counts['correct']}** correct pairs. Whole run: "
            f"{meta['collect_min']:.1f} min.",
            "Headroom: the worst correct pair needs k = "
            + ", ".join(f"{v:.2g} ({m})" for m, v in counts["worst_correct"].items())
            + "; the least visible bug ({1}) reaches k = {0:.3g} on its most telling metric.".format(
                *min(counts["weakest_bug"], default=(float("nan"), "-"))
            ),
            text,
        )
    )
    print(body)
    if not args.no_write:
        write_section("twin-calibration", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

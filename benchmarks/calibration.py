"""``convergence calibrate`` on this machine: the floors it measures next to the shipped
defaults, and what the run costs.

Runs the command (the debug config by default, its default layouts and 30 steps) into a
temporary workdir, or reads a calibration file it wrote (``--load FILE``), prints a table per
regime and metric -- shipped default, measured need, calibrated value -- and writes the
section "calibration" of BENCHMARKS.md with the machine named.

    python benchmarks/calibration.py                       # ~5-10 min on 2 CPU cores
    python benchmarks/calibration.py --load .convergence/calibration/<hash>.json --no-write
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report

from _report import machine, write_section

from convergence.stats.paired_band import PAIRED_DEFAULTS
from convergence.stats.twin_envelope import TWIN_DEFAULTS


def run(config: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        out = Path(tmp) / "calibration.json"
        subprocess.run(
            [sys.executable, "-m", "convergence.cli", "calibrate", config, "--steps", str(steps)]
            + ["--workdir", str(Path(tmp) / "work"), "--out", str(out)],
            check=True,
        )
        data: dict[str, Any] = json.loads(out.read_text())
        return data


def table(data: dict[str, Any]) -> str:
    measured = data["obtained"].get("measured", {})
    rows = [
        "| regime | metric | shipped default | measured need | calibrated |",
        "|---|---|---|---|---|",
    ]
    for metric, values in data["paired"].items():
        if metric == "val_loss":
            continue
        d = PAIRED_DEFAULTS[metric]
        raw = measured.get("paired", {}).get(metric, {})
        rows.append(
            f"| paired (fp32) | {metric} | atol {d.atol:g}, rtol {d.rtol:g} | "
            f"max abs diff {raw.get('max_abs_diff', float('nan')):.3g} "
            f"(atol {raw.get('atol_needed', float('nan')):.3g}) | "
            f"atol {values['atol']:.3g}, rtol {values['rtol']:.3g} |"
        )
    for metric, values in data["twin"].items():
        if metric == "val_loss":
            continue
        t = TWIN_DEFAULTS[metric]
        raw = measured.get("twin", {}).get(metric, {})
        rows.append(
            f"| twin (bf16) | {metric} | k {t.k:g}, rtol {t.rtol:g} | "
            f"k {raw.get('k_needed', float('nan')):.3g}, rtol "
            f"{raw.get('rtol_needed', float('nan')):.3g} (twin noise max "
            f"{raw.get('twin_noise_max', float('nan')):.3g}) | "
            f"k {values['k']:.3g}, rtol {values['rtol']:.3g} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--load", type=Path, help="a calibration file already written")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    data = json.loads(args.load.read_text()) if args.load else run(args.config, args.steps)
    how = data["obtained"]
    text = table(data)
    print(text)
    if args.no_write:
        return 0
    body = "\n\n".join(
        (
            "## Calibration on this machine (benchmarks/calibration.py)",
            f"Machine: {machine()}. `convergence calibrate {how['source']}` "
            f"({how['steps']} steps, seed {how['seed']}, margin {how['margin']:g}): control "
            f"FSDP(2); fp32 layouts {', '.join(how['fp32_layouts']) or '-'}; bf16 layouts "
            f"{', '.join(how['bf16_layouts']) or '-'} against the control and its noise twin. "
            f"Stack {data['stack_hash']} ({data['stack']['hardware']}, torch "
            f"{data['stack']['torch']}). Whole run {how['wall_s'] / 60:.1f} min (measured "
            f"{how['date']}). Measured need: the value that covers the worst layout exactly "
            "(before the margin); calibrated = max(shipped, margin x need).",
            text,
        )
    )
    write_section("calibration", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

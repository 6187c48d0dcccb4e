"""bf16 false alarms and detection on this machine's devices, placed as the plugin places them.

The correct layouts (false alarms) and planted bugs (detection) of the detection catalogue, in
bf16 (parameters in bf16 on both sides, the twin regime) on a train config other than debug
(benchmarks/detection/envelope/: ``b`` a wider GQA model on byte-level text by default), with
early stopping on and the numerics probe off (it only costs here). Each pair is placed as
collection places it (convergence.launch.placement: one GPU per rank, ranks sharing a GPU
over gloo, or CPU), so on a one-GPU machine the layouts gloo runs on CUDA share the GPU.

    python benchmarks/gpu_sweep.py --seeds 7 8 --json /tmp/sweep.json
    python benchmarks/gpu_sweep.py --seeds 7 --cases fsdp2-cp2 --steps 4   # a dry run on CPU
    python benchmarks/gpu_sweep.py --merge /tmp/s7.json /tmp/s8.json --json /tmp/sweep.json

Prints one line per pair as it ends and a table at the end; ``--json`` keeps the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "detection"))  # catalogue, pairs, run

from catalogue import ALL, Case  # noqa: E402
from pairs import build_pairs  # noqa: E402
from run import as_bf16  # noqa: E402

from convergence.launch.devices import session_devices  # noqa: E402
from convergence.preflight import validate_devices  # noqa: E402
from convergence.run.runner import Runner, RunSettings  # noqa: E402
from convergence.spec.errors import NotRunnableHere  # noqa: E402

CONFIGS = {
    "a": HERE / "detection" / "envelope" / "a_debug_synthetic.toml",
    "b": HERE / "detection" / "envelope" / "b_wide_gqa_text.toml",
    "c": HERE / "detection" / "envelope" / "c_long_lag_synthetic.toml",
}
#: Layouts whose collectives gloo runs on CUDA tensors (a one-GPU machine shares the GPU), all
#: with FSDP (bf16 parameters are applied through FSDP2's mixed precision: no DDP-only layout).
CORRECT = ("fsdp2-cp2", "hsdp2x2", "fsdp4", "fsdp2-accum2")
BUGS = (
    "fsdp-dp-rank-dropped",
    "cp-rope-ignores-offset",
    "hsdp-sum-not-average",
    "dp-ranks-read-same-shard",
)


def cases(seed: int, names: list[str]) -> list[Case]:
    by_name = {c.name: c for c in ALL}
    return [as_bf16(dataclasses.replace(by_name[n], seed=seed)) for n in names]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    devices = session_devices("local")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-sweep-") as tmp:
        work = Path(tmp)
        runner = Runner(RunSettings(work_dir=work / "work", idle_limit_s=300, wall_limit_s=900))
        for seed in args.seeds:
            group = cases(seed, args.cases)
            (work / f"seed{seed}").mkdir(parents=True)
            pairs = build_pairs(group, work / f"seed{seed}", steps=args.steps, config=args.config)
            for case in group:
                pair = dataclasses.replace(pairs[case.name], probe_on_failure=False)
                row: dict[str, Any] = {"case": case.name, "kind": case.kind, "seed": seed}
                try:
                    pair = validate_devices(pair, available_devices=devices)
                except NotRunnableHere as exc:
                    row.update(status="not placed", placement=exc.detail, wall_s=0.0)
                    rows.append(row)
                    print(_line(row), flush=True)
                    continue
                start = time.monotonic()
                outcome = runner.run_pair(pair)
                row.update(
                    status=outcome.status,
                    placement=pair.placement,
                    wall_s=round(time.monotonic() - start, 1),
                    stopped_at=outcome.stopped_early_at,
                    failing=[v.metric for v in outcome.verdicts if v.gate and not v.passed],
                    error=(outcome.error or "").splitlines()[-1:] or None,
                )
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _verdict(row: dict[str, Any]) -> str:
    if row["kind"] == "bug":
        return "caught" if row["status"] == "failed" else f"MISSED ({row['status']})"
    return "passed" if row["status"] == "passed" else f"FALSE ALARM ({row['status']})"


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['kind']:7s} {row['case']:28s} seed {row['seed']} {_verdict(row):22s} "
        f"{row.get('wall_s', 0):6.1f} s  {row.get('placement', '')}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| pair | kind | seed | verdict | stopped at | wall s | placement |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['kind']} | {r['seed']} | {_verdict(r)} | "
            f"{r.get('stopped_at') or '-'} | {r.get('wall_s', 0)} | {r.get('placement', '')} |"
        )
    correct = [r for r in rows if r["kind"] == "correct" and r["status"] != "not placed"]
    bugs = [r for r in rows if r["kind"] == "bug" and r["status"] != "not placed"]
    alarms = sum(r["status"] != "passed" for r in correct)
    caught = sum(r["status"] == "failed" for r in bugs)
    lines.append("")
    lines.append(f"false alarms {alarms}/{len(correct)}; planted bugs caught {caught}/{len(bugs)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="b", help="a, b, c (benchmarks/detection/envelope)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[7, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cases", nargs="*", default=[*CORRECT, *BUGS])
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--merge", type=Path, nargs="*", help="print the table of these --json files, run nothing"
    )
    args = parser.parse_args()
    args.config = CONFIGS.get(args.config, Path(args.config))
    if args.merge is not None:
        rows = [
            row for path in args.merge if path.is_file() for row in json.loads(path.read_text())
        ]
    else:
        rows = run(args)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

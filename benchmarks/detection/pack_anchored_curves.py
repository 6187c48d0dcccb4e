"""Pack saved run folders into the envelope curve format, so twin verdicts can be re-judged
offline (benchmarks/detection/twin_unstable.py) without the run folders.

    python benchmarks/detection/pack_anchored_curves.py WORK CONFIG OUT.json.gz
    python benchmarks/detection/pack_anchored_curves.py --extra OUT.json.gz \\
        NAME=DUMP:PRECISION:KIND ...

First form: WORK is a benchmarks/detection/anchored.py ``--workdir`` (its
``runs/<experiment>_<case>/`` folders: control, noise twin, forward-noise twin, test, and their
anchored one-step runs); CONFIG the config letter written into each case. Second form: single
runs (a trainer's ``metrics.dump_folder``), each under NAME with its precision (bf16, fp32)
and kind (test: judged against the first form's control and twins; twin: a candidate twin;
control).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

METRICS = ("loss", "grad_norm", "grad_norm_parts")


def curves(dump: Path) -> dict[str, list[list[float]]]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").open()]
    return {
        m: [[r["step"] for r in rows if m in r], [r[m] for r in rows if m in r]] for m in METRICS
    }


def _run(runs: list[Path], prefix: str) -> Path:
    """The run folder named ``prefix<hash>`` in any case folder: the control group ran once,
    in the first case, and the cache served the others."""
    for case in runs:
        for run in sorted(case.iterdir()):
            rest = run.name.removeprefix(prefix)
            if run.name.startswith(prefix) and "-" not in rest:
                return run
    raise SystemExit(f"no {prefix}* run")


def pack_work(work: Path, config: str) -> dict[str, Any]:
    runs = sorted((work / "runs").iterdir())
    control = curves(_run(runs, "control-fsdp2-") / "dump")
    twins = [
        curves(_run(runs, "control-fsdp2-twin-") / "dump"),
        curves(_run(runs, "control-fsdp2-fwd-twin-") / "dump"),
    ]
    anchored_twins = [
        curves(_run(runs, "control-fsdp2-twin-anchored-") / "dump"),
        curves(_run(runs, "control-fsdp2-fwd-twin-anchored-") / "dump"),
    ]
    data: dict[str, Any] = {}
    for case in runs:
        name = case.name.split(".toml_", 1)[1]
        tests = sorted(r for r in case.iterdir() if r.name.startswith("test-"))
        main = [r for r in tests if "-anchored-" not in r.name]
        anchored = [r for r in tests if "-anchored-" in r.name]
        for test in main:
            data[f"{config}/{name}/seed7"] = {
                "config": config,
                "case": name,
                "kind": "bug" if "-from-" in name else "correct",
                "seed": 7,
                "status": "ok",
                "control": control,
                "twins": twins,
                "test": curves(test / "dump"),
                # One step from each of the control's anchors: the test layout, then the twins.
                "anchored": [curves(r / "dump") for r in anchored[:1]] + anchored_twins,
            }
    return data


def pack_extra(specs: list[str]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for spec in specs:
        name, rest = spec.split("=", 1)
        dump, precision, kind = rest.rsplit(":", 2)
        runs[name] = {**curves(Path(dump)), "precision": precision, "kind": kind}
    return {"runs": runs}


def main() -> int:
    if sys.argv[1] == "--extra":
        out, data = Path(sys.argv[2]), pack_extra(sys.argv[3:])
    else:
        out, data = Path(sys.argv[3]), pack_work(Path(sys.argv[1]), sys.argv[2])
    out.write_bytes(gzip.compress(json.dumps(data).encode()))
    print(f"{out}: {len(data.get('runs', data))} entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

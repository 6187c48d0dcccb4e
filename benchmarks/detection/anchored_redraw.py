"""The anchored jobs of an earlier anchored benchmark run, again, with more steps per anchor.

benchmarks/detection/anchored.py saves each pair's run folders (the control's anchors in its
cached run, the anchored jobs' job.json). This reruns only the anchored jobs -- the test
layouts' and the twins' -- from the same anchors with ``checkpoint.anchored_steps = M`` (the
pair key ``anchor_steps``), into a new work folder, without the 500-step runs; then
``anchored.py --rejudge NEW_WORK --anchor-steps m`` judges them for any m <= M (steps K+1..K+m
of an M-step job are the m-step job's: training is deterministic).

    python benchmarks/detection/anchored_redraw.py /tmp/anch/a500 /tmp/anch/a500m8 \\
        --anchor-steps 8 [--only cp-rope fsdp2-tp2 twin]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pairs (PYTHONPATH for the hooks)

from pairs import put_bugs_on_path

from convergence.report.data.serialize import job_from_json
from convergence.run.jobs import JobRunner, RunSettings

REPO = Path(__file__).resolve().parents[2]


def local_config(path: Path) -> Path:
    """The same train config in this checkout (the saved runs name another worktree's)."""
    for top in ("train_configs", "benchmarks"):
        if top in path.parts:
            return REPO.joinpath(*path.parts[path.parts.index(top) :])
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("saved", type=Path, help="an anchored.py --work folder")
    parser.add_argument("new", type=Path, help="where the new anchored jobs go")
    parser.add_argument("--anchor-steps", type=int, required=True)
    parser.add_argument("--only", nargs="*", default=[], help="substrings of job names")
    args = parser.parse_args()
    put_bugs_on_path()
    runner = JobRunner(RunSettings(work_dir=args.new / "work", idle_limit_s=900))
    for path in sorted((args.saved / "work" / "runs").glob("*/*-anchored-*/job.json")):
        saved = json.loads(path.read_text())
        if args.only and not any(s in saved["name"] for s in args.only):
            continue
        job = job_from_json({**saved["job"], "name": saved["name"]})
        job = dataclasses.replace(
            job,
            train_config=local_config(job.train_config),
            overrides=(*job.overrides, ("checkpoint.anchored_steps", str(args.anchor_steps))),
        )
        side = path.parent.name.split("-")[0]  # "test" or "control"
        pair_dir = args.new / "work" / "runs" / path.parents[1].name
        # The rejudge reads the control's curve from the pair's folder: copy it over.
        for control in path.parents[1].glob("control-*"):
            if "-anchored-" not in control.name and not (pair_dir / control.name).exists():
                shutil.copytree(control, pair_dir / control.name, ignore=_no_anchors)
        start = time.monotonic()
        outcome = runner.run_job(side, job, pair_dir=pair_dir, cacheable=False)
        print(
            json.dumps(
                {
                    "pair": path.parents[1].name,
                    "job": saved["name"],
                    "anchor_steps": args.anchor_steps,
                    "wall_s": round(time.monotonic() - start, 1),
                    "saved_one_step_wall_s": round(saved["wall_s"], 1),
                    "run_dir": str(outcome.run_dir),
                }
            ),
            flush=True,
        )
    return 0


def _no_anchors(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "anchors"]


if __name__ == "__main__":
    raise SystemExit(main())

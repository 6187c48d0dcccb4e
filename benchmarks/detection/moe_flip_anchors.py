"""The anchored check of bf16 MoE pairs re-judged from their run folders, with and without the
flip-anchor exemption from the persistence rule (convergence/stats/routing_flips.py), no
training: the same runs under both rules.

    python benchmarks/moe_pairs.py --precision bf16 --tests tp2-ep2 --work W ...
    python benchmarks/detection/moe_flip_anchors.py W [W ...]

Per pair folder under ``W/work/runs/``: the control, its noise and forward-noise twins, their
anchored one-step runs, the test and its anchored run (benchmarks/moe_pairs.py's layout). Prints
per pair the tokens the test's and the twins' one steps moved at each anchored step, the flip
anchors, and the verdict under both rules (the persistence rule at every anchor: the rule
before; flip anchors exempt: today's).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import PART_NORM_PREFIX, ROUTING_PREFIX, read_jsonl, read_prefixed
from convergence.regimes import default_rules
from convergence.stats.anchored import anchored_verdict
from convergence.stats.routing_flips import flip_steps, tokens_moved
from convergence.stats.types import MetricVerdict


def _metrics(job: Path) -> RunMetrics:
    (path,) = job.rglob("metrics.jsonl")
    return {**read_jsonl(path), **read_prefixed(path, PART_NORM_PREFIX, ROUTING_PREFIX)}


def _job(folder: Path, prefix: str, *, anchored: bool) -> Path:
    """The job folder ``<prefix><hash>`` (``<prefix>anchored-<hash>`` when ``anchored``)."""
    head = f"{prefix}anchored-" if anchored else prefix
    found = [
        d for d in folder.iterdir() if d.name.startswith(head) and "-" not in d.name[len(head) :]
    ]
    if len(found) != 1:
        raise SystemExit(
            f"{folder}: expected one job {head}<hash>, found {[d.name for d in found]}"
        )
    return found[0]


def _control_folder(folder: Path) -> Path:
    """The pair folder holding the control group's jobs: this one, or (a planted bug's pair,
    whose controls the cache served) a sibling of the same seed (``moe_<seed>_...``)."""
    seed = folder.name.split("_")[1]
    for candidate in [folder, *sorted(folder.parent.glob(f"moe_{seed}_*"))]:
        if any(d.name.startswith("control-") for d in candidate.iterdir()):
            return candidate
    raise SystemExit(f"{folder}: no control jobs in it or beside it")


def rejudge(folder: Path) -> list[str]:
    tests_here = [d.name for d in folder.iterdir()]
    folder_of_tests, folder = folder, _control_folder(folder)
    names = [d.name for d in folder.iterdir()]
    control_prefix = next(n for n in names if n.startswith("control-fsdp") and "twin" not in n)
    control_prefix = control_prefix.rsplit("-", 1)[0] + "-"
    tests = sorted(
        {n.rsplit("-", 1)[0] for n in tests_here if n.startswith("test-") and "-anchored-" not in n}
    )
    control = _metrics(_job(folder, control_prefix, anchored=False))
    twins = [
        _metrics(_job(folder, f"{control_prefix}twin-", anchored=False)),
        _metrics(_job(folder, f"{control_prefix}fwd-twin-", anchored=False)),
    ]
    anchored_twins = [
        _metrics(_job(folder, f"{control_prefix}twin-", anchored=True)),
        _metrics(_job(folder, f"{control_prefix}fwd-twin-", anchored=True)),
    ]
    rules = [r for r in default_rules("twin") if r.gate]
    rows = []
    for test in tests:
        anchored = _metrics(_job(folder_of_tests, f"{test}-", anchored=True))
        steps = anchored["loss"].steps.tolist()
        every = int(steps[1] - steps[0])
        moved = tokens_moved(control, anchored)
        twin_moved = [tokens_moved(control, t) for t in anchored_twins]
        flips = sorted(flip_steps(control, anchored, anchored_twins))
        dense = {k: v for k, v in anchored.items() if not k.startswith(ROUTING_PREFIX)}
        before = anchored_verdict(
            rules, [control, *twins], dense, every=every, anchored_twins=anchored_twins
        )
        today = anchored_verdict(
            rules, [control, *twins], anchored, every=every, anchored_twins=anchored_twins
        )
        worst = max(today.details["max_ratio_by_metric"].values())

        def said(v: MetricVerdict) -> str:
            return "pass" if v.passed else f"FAIL at anchor {v.details['anchor_step']}"

        rows.append(
            f"| {folder_of_tests.name.split('.toml')[0]} | {test.removeprefix('test-')} "
            f"| {' '.join(str(moved.get(s, '-')) for s in steps)} "
            f"| {' '.join(str(max(t.get(s, 0) for t in twin_moved)) for s in steps)} "
            f"| {len(flips)}/{len(steps)} | {worst:.2f} | {said(before)} | {said(today)} |"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path, nargs="+", help="benchmarks/moe_pairs.py --work folders")
    args = parser.parse_args()
    print(
        f"rounding draw (env): {os.environ.get('CONVERGENCE_ROUNDING_DRAW', '0')}", file=sys.stderr
    )
    print(
        "| pair | test | tokens moved by the test's one step, per anchor | most moved by an "
        "anchored twin | flip anchors | worst share | persistence everywhere | flip anchors "
        "exempt |"
    )
    print("|---|---|---|---|---|---:|---|---|")
    for work in args.work:
        for folder in sorted((work / "work" / "runs").iterdir()):
            if folder.is_dir() and any(d.name.startswith("test-") for d in folder.iterdir()):
                try:
                    print("\n".join(rejudge(folder)))
                except SystemExit as err:
                    print(f"| {folder.name} | skipped: {err} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

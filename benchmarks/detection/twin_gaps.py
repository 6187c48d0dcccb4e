"""Which twin covers which layout's one-step gaps, per metric (issue 47, the bf16 TP false
alarm; BENCHMARKS.md "tptwin"): no training, from far.py's dense-anchor groups.

    python benchmarks/detection/twin_gaps.py gaps FOLDER [FOLDER ...]
    python benchmarks/detection/twin_gaps.py merge OLD.json.gz NEW.json.gz OUT.json.gz

``gaps``: per metric, the median (and max) over the anchors of the relative one-step gap
|run - control| / |control| of the DP twin, the forward-noise twin and each correct layout's
anchored run. ``merge``: a group with OLD's test runs and NEW's control group (control, twins,
anchored twins) -- the test runs do not depend on the twin's code (checked: bit-identical where
both groups have them), so a twin variant is judged on TP by rerunning only its control group
(far.py --layouts fsdp2-cp2) and merging; far_draws.py then judges the merged group.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # far_judge

from far_judge import load

METRICS = ("loss", "grad_norm", "grad_norm_parts", "update_norm_parts")
LAYOUTS = ("fsdp2-tp2", "fsdp2-cp2", "fsdp2-pp2-1f1b", "hsdp2x2")


def relative_gaps(run: Any, control: Any, metric: str) -> np.ndarray:
    ref = dict(zip(control[metric].steps.tolist(), control[metric].values.tolist(), strict=True))
    cur = run[metric]
    return np.array(
        [
            abs(v - ref[s]) / abs(ref[s])
            for s, v in zip(cur.steps.tolist(), cur.values.tolist(), strict=True)
            if s in ref and ref[s] != 0
        ]
    )


def gap_lines(path: Path) -> list[str]:
    g = load(path)
    lines = [f"{path}"]
    metrics = [m for m in g.anchored_twins[0] if m in METRICS or m.startswith("grad_norm/")]
    for m in metrics:
        cells = []
        for name, run in (("dp", g.anchored_twins[0]), ("fwd", g.anchored_twins[1])):
            r = relative_gaps(run, g.control, m)
            cells.append(f"{name} {np.median(r):.2e} (max {r.max():.2e})")
        for layout in LAYOUTS:
            if layout in g.anchored:
                r = relative_gaps(g.anchored[layout], g.control, m)
                cells.append(f"{layout} {np.median(r):.2e} (max {r.max():.2e})")
        lines.append(f"  {m:28s} " + "  ".join(cells))
    return lines


def merge(old: Path, new: Path, out: Path) -> None:
    o = json.loads(gzip.decompress(old.read_bytes()))
    n = json.loads(gzip.decompress(new.read_bytes()))

    def by_kind(runs: dict[str, Any]) -> dict[str, Any]:
        return {name.rsplit("-", 1)[0]: rows for name, rows in runs.items()}

    old_runs, new_runs = by_kind(o["runs"]), by_kind(n["runs"])
    if old_runs["control-fsdp2"] != new_runs["control-fsdp2"]:
        raise SystemExit("the controls differ: not the same group")
    for kind, rows in new_runs.items():
        if kind.startswith("test-") and kind in old_runs and old_runs[kind] != rows:
            raise SystemExit(f"{kind} differs between the groups")
    runs = {k: v for k, v in o["runs"].items() if k.startswith("test-")}
    runs.update({k: v for k, v in n["runs"].items() if k.startswith("control-")})
    merged = {**o, "runs": runs, "merged_from": [str(old), str(new)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(json.dumps(merged).encode(), mtime=0))


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "gaps":
        for folder in sys.argv[2:]:
            for path in sorted(Path(folder).glob("*-bf16-*.json.gz")):
                print("\n".join(gap_lines(path)))
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "merge":
        merge(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

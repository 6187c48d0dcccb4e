"""Turn catalogue cases into experiment files and validated pairs, and run them.

One experiment file per control group (seed x precision): the cases of a group share its
control, so the run cache executes that control once.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from catalogue import Case

from convergence.preflight import load_checked
from convergence.spec.pair import PairSpec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def put_bugs_on_path() -> None:
    """The ranks import ``detection_bugs`` (PYTHONPATH); this process locates it (sys.path)
    for the collection check and the run cache's hook hash."""
    here = str(HERE)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])
    if here not in sys.path:
        sys.path.insert(0, here)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):  # a nested inline table (resume = { parallelism = {...} })
        return _inline(value)
    raise TypeError(f"cannot write {value!r} into TOML")


def _inline(table: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in table.items()) + " }"


def _job_lines(case_like: dict[str, Any]) -> list[str]:
    lines = [f"parallelism = {_inline(case_like['parallelism'])}"]
    if case_like.get("techniques"):
        lines.append(f"techniques = {_inline(case_like['techniques'])}")
    if case_like.get("local_batch_size"):
        lines.append(f"local_batch_size = {case_like['local_batch_size']}")
    return lines


DEBUG_CONFIG = REPO / "train_configs" / "debug.toml"


def experiment_text(
    cases: Sequence[Case],
    *,
    seed: int,
    precision: str,
    steps: int,
    config: Path = DEBUG_CONFIG,
    anchor_every: int = 0,
    max_norm: float | None = None,
) -> str:
    techniques = {"param_dtype": "bfloat16"} if precision == "bf16" else {}
    lines = [
        "[defaults]",
        f"train_config = {_value(str(config))}",
        f"steps = {steps}",
        f"seed = {seed}",
        # Localisation is a separate feature (and costs two probe jobs per failure).
        'probe = "off"',
        *([f"anchor_every = {anchor_every}"] if anchor_every else []),
        *([f'overrides = {{ "training.max_norm" = {max_norm!r} }}'] if max_norm else []),
        "",
        "[control]",
        'name = "fsdp2"',
        *_job_lines({"parallelism": {"dp_shard": 2}, "techniques": techniques}),
    ]
    for case in cases:
        lines += [
            "",
            "[[test]]",
            f"name = {_value(case.name)}",
            *_job_lines(
                {
                    "parallelism": case.parallelism,
                    "techniques": case.techniques,
                    "local_batch_size": case.local_batch_size,
                }
            ),
        ]
        if case.hook:
            lines += [f"hook = {_value(case.hook)}", f"hook_mode = {_value(case.hook_mode)}"]
        if case.resume:
            lines.append(f"resume = {_inline(case.resume)}")
    return "\n".join(lines) + "\n"


def build_pairs(
    cases: Iterable[Case],
    folder: Path,
    *,
    steps: int,
    config: Path = DEBUG_CONFIG,
    anchor_every: int = 0,
) -> dict[str, PairSpec]:
    """Write one experiment file per control group into ``folder``; the pairs by case name."""
    put_bugs_on_path()
    groups: dict[tuple[int, str, float | None], list[Case]] = defaultdict(list)
    for case in cases:
        groups[(case.seed, case.precision, case.max_norm)].append(case)
    pairs: dict[str, PairSpec] = {}
    for (seed, precision, max_norm), members in groups.items():
        clip = f"_clip{max_norm:g}" if max_norm else ""
        path = folder / f"detection_seed{seed}_{precision}{clip}.toml"
        path.write_text(
            experiment_text(
                members,
                seed=seed,
                precision=precision,
                steps=steps,
                config=config,
                anchor_every=anchor_every,
                max_norm=max_norm,
            )
        )
        for pair in load_checked(path, rootdir=REPO).pairs:
            pairs[pair.name] = pair
    return pairs

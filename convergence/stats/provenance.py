"""Where a golden curve came from, and whether the run judged against it came from the same place.

A golden is compared against runs made months later on other machines. When the test drifts,
the first question is "same torch? same GPU?": the golden records the environment of its run
(torch and CUDA versions, hardware), the git commit of the code that exported it, a hash of the
run's resolved config and its layout, and the comparison names every environment key that
differs. The commit and config are provenance only: a different commit is the point of a golden.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from convergence.cache.key import hardware_fingerprint
from convergence.metrics.golden import golden_metadata
from convergence.metrics.reader import describe_source
from convergence.spec import run_dir
from convergence.stats.types import MetricVerdict

#: Keys of ``metadata["environment"]`` whose difference can move a curve by itself.
ENVIRONMENT_KEYS: tuple[str, ...] = ("torch", "cuda", "hardware")
#: Where a run folder of ours keeps the trainer's own record (torch version, layout, config).
RUN_META = (run_dir.RUN_META, f"{run_dir.DUMP}/{run_dir.RUN_META}")


def golden_provenance(run_path: Path, *, source_kind: str = "") -> dict[str, Any]:
    """The metadata ``convergence export-golden`` stores with the curves of ``run_path``."""
    run_meta = read_run_meta(run_path)
    config = run_meta.get("config")
    return {
        "source": str(run_path),
        "source_kind": source_kind,
        "exported_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": run_environment(run_meta),
        "git_commit": git_commit(Path.cwd()),
        "config_hash": _hash(config) if isinstance(config, dict) else None,
        "layout": run_meta.get("layout"),
        "world_size": run_meta.get("world_size"),
    }


def read_run_meta(run_path: Path) -> dict[str, Any]:
    """The trainer's ``run_meta.json`` of a run folder of ours; ``{}`` for anything else."""
    run_path = Path(run_path)
    for name in RUN_META:
        candidate = run_path / name
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def run_environment(run_meta: Mapping[str, Any]) -> dict[str, Any]:
    """torch/CUDA versions and hardware of a run: the run's own record where it has one (its
    torch version), this machine's for the rest (export and runs normally share a machine)."""
    import torch

    return {
        "torch": str(run_meta.get("torch_version") or torch.__version__),
        "cuda": torch.version.cuda,
        "hardware": hardware_fingerprint(),
    }


def environment_differences(golden: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``["torch 2.5.1 -> 2.13.0", ...]`` for every environment key both sides know and that
    differs; a golden exported before provenance was recorded has nothing to compare."""
    recorded = golden.get("environment")
    if not isinstance(recorded, Mapping):
        return []
    return [
        f"{key} {recorded[key]} -> {current[key]}"
        for key in ENVIRONMENT_KEYS
        if key in recorded and key in current and recorded[key] != current[key]
    ]


def environment_note(
    golden_path: Path, golden: Mapping[str, Any], current: Mapping[str, Any]
) -> str | None:
    """One sentence for the verdict message, or None when the environments match."""
    differences = environment_differences(golden, current)
    if not differences:
        return None
    return (
        f"golden {golden_path} was recorded in another environment "
        f"({'; '.join(differences)}): a deviation may come from the environment, not the "
        f"code; re-export the golden here to tell them apart"
    )


def with_golden_note(
    golden_path: Path, verdicts: Sequence[MetricVerdict], test_run_meta: Mapping[str, Any]
) -> tuple[MetricVerdict, ...]:
    """``verdicts`` with the environment note on the loss verdict when ``golden_path`` is a
    golden file recorded elsewhere than the test run (unchanged otherwise)."""

    if describe_source(golden_path) != "golden":
        return tuple(verdicts)
    note = environment_note(
        golden_path, golden_metadata(golden_path), run_environment(test_run_meta)
    )
    if note is None:
        return tuple(verdicts)
    return tuple(
        dataclasses.replace(v, message=f"{v.message}; {note}" if v.message else note)
        if v.metric == "loss"
        else v
        for v in verdicts
    )


def git_commit(folder: Path) -> str | None:
    """HEAD of the git repository holding ``folder`` (with ``-dirty`` for uncommitted changes),
    or None outside a repository or without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


__all__ = [
    "ENVIRONMENT_KEYS",
    "environment_differences",
    "environment_note",
    "git_commit",
    "golden_provenance",
    "read_run_meta",
    "run_environment",
    "with_golden_note",
]

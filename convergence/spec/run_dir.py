"""The files of a run folder, named once for both sides of the process boundary.

    <run>/                      RunDir: one job's folder (in the run cache or a pair's folder)
        job.json                what ran (the job's identity, name, session)
        logs/                   the launcher's per-rank logs
        dump/                   DumpDir: the trainer's output folder (``--metrics.dump_folder``)
            metrics.jsonl       one JSON line per logged step, exact float64 (the built-in
                                trainer; a command backend's default)
            run_meta.json       the trainer's record of the run (torch, layout, config, ...)
            tb/                 TensorBoard event files
            STOP                created by the launcher: stop at the next step
            probe.json          a probe job's record (convergence/trainer/probe.py)
            convergence_steps.jsonl
                                the torchtitan wrapper's per-step records
            anchors/step<K>/    the anchored check's control: its state after step K

The library (run/, checks/, backends/) and the trainers (trainer/, the torchtitan wrapper) all
read these names from here, so a renamed file is renamed on both sides at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DUMP = "dump"
METRICS = "metrics.jsonl"
RUN_META = "run_meta.json"
ANCHORS = "anchors"
ANCHOR_PREFIX = "step"


@dataclass(frozen=True)
class DumpDir:
    """A trainer's output folder and the files in it."""

    path: Path

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def run_meta(self) -> Path:
        return self.path / RUN_META

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def stop(self) -> Path:
        return self.path / "STOP"

    @property
    def probe(self) -> Path:
        return self.path / "probe.json"

    @property
    def step_log(self) -> Path:
        return self.path / "convergence_steps.jsonl"

    @property
    def anchors(self) -> Path:
        return self.path / ANCHORS

    def anchor(self, step: int) -> Path:
        """The anchor of the state after ``step``."""
        return anchor_path(self.anchors, step)


@dataclass(frozen=True)
class RunDir:
    """One job's run folder."""

    path: Path

    @property
    def dump(self) -> DumpDir:
        return DumpDir(self.path / DUMP)

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def job_record(self) -> Path:
        return self.path / "job.json"


def anchor_path(folder: Path, step: int) -> Path:
    """The anchor of the state after ``step`` in an anchors ``folder``."""
    return folder / f"{ANCHOR_PREFIX}{step}"


def anchor_step(name: str) -> int | None:
    """K when ``name`` is an anchor's folder name (``step<K>``), else None."""
    number = name.removeprefix(ANCHOR_PREFIX)
    return int(number) if name.startswith(ANCHOR_PREFIX) and number.isdigit() else None


def anchor_of(path: Path) -> tuple[Path, int] | None:
    """(the anchors folder, K) when ``path`` is an anchor (``.../anchors/step<K>``), else None."""
    step = anchor_step(path.name)
    return None if step is None or path.parent.name != ANCHORS else (path.parent, step)

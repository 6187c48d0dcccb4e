"""Following a running job's TensorBoard event files: its live metrics, step by step.

What torchtitan 0.3.0 allows: its ``TensorBoardLogger`` is a ``SummaryWriter(max_queue=1000)``
with the default ``flush_secs=120``, which reads as if the file were written only every two
minutes. It is not: the writer thread takes each event off the queue as it comes, and
TensorBoard's own ``GFile`` (used when TensorFlow is not installed) appends every record to a
local file at once (open, append, close); ``flush_secs`` only matters where it buffers. Tried
with torchtitan's logger writing a step every 0.25 s: every step's scalars were on disk at the
next 1 s poll, 80 of 80 (tests/test_metrics_tb_tail.py keeps the live read true). With
TensorFlow installed, or a file system without append (an object store), the bytes wait for the
flush: the live steps then come every two minutes, late but still right (the final read is the
same file). The values are float32 (``simple_value``), as the final read's.

:class:`TensorBoardTail` returns *complete* steps, as records ``{"step": s, "<tag>": value}``
with the writer's own tag names (the backend's ``record_keys`` maps them to ours, as for JSONL):
a step is complete once a later step appears, or once it holds every tag the previous complete
step held (torchtitan logs a step's scalars in one call, so its last step need not wait for the
job's exit). Steps only move forward: a value logged later for an already returned step
(validation) is left to the final read.

Folders: event files may sit in ``<root>/<timestamp>/`` or ``.../rank_<N>/``. With pipeline
parallelism the non-last stages log a placeholder loss (-1.0); the tail follows the first
folder (lowest rank) whose loss is real, or, when no folder has one of the known loss tags
(a trainer with its own tag names), the lowest-rank folder that has any scalar.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from convergence.metrics.tags import TENSORBOARD_TAGS, sources_for
from convergence.metrics.tensorboard import (
    EVENT_GLOB,
    PLACEHOLDER_LOSS,
    event_scalars,
    rank_of,
    split_records,
)

LOSS_TAGS = frozenset(sources_for(TENSORBOARD_TAGS, "loss"))


class _FileTail:
    """Byte offset into one event file; bytes of a record still being written wait."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.inode: int | None = None

    def new_records(self) -> list[bytes]:
        try:
            with self.path.open("rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self.inode or stat.st_size < self.offset:
                    self.inode, self.offset = stat.st_ino, 0  # replaced: read it again
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        records, used = split_records(data, self.path)
        self.offset += used
        return records


class TensorBoardTail:
    """The complete steps written under ``root`` since the last poll (see module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._files: dict[Path, _FileTail] = {}
        self._steps: dict[Path, dict[int, dict[str, float]]] = {}
        """Per folder: step -> {tag: value}, not yet returned."""
        self._folder: Path | None = None
        self._last = 0
        """The last step returned."""
        self._last_tags: frozenset[str] = frozenset()

    def poll(self) -> list[dict[str, Any]]:
        self._read()
        return self._complete(final=False)

    def drain(self) -> list[dict[str, Any]]:
        """After the job ended: every step left, complete or not."""
        self._read()
        return self._complete(final=True)

    def _read(self) -> None:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob(EVENT_GLOB)):
            tail = self._files.setdefault(path, _FileTail(path))
            steps = self._steps.setdefault(path.parent, {})
            for record in tail.new_records():
                for tag, step, value in event_scalars(record):
                    steps.setdefault(step, {})[tag] = value

    def _choose(self) -> Path | None:
        if self._folder is not None:
            return self._folder
        order = sorted(self._steps, key=lambda f: (rank_of(f) or 0, str(f)))
        real = [
            f
            for f in order
            if any(
                v != PLACEHOLDER_LOSS
                for tags in self._steps[f].values()
                for t, v in tags.items()
                if t in LOSS_TAGS
            )
        ]
        known = any(t in LOSS_TAGS for f in order for tags in self._steps[f].values() for t in tags)
        if real:
            self._folder = real[0]
        elif not known:
            self._folder = next((f for f in order if self._steps[f]), None)
        return self._folder

    def _complete(self, *, final: bool) -> list[dict[str, Any]]:
        folder = self._choose()
        if folder is None:
            return []
        pending = self._steps[folder]
        out = []
        for step in sorted(pending):
            tags = pending[step]
            if step <= self._last:  # logged again later (validation): the final read has it
                del pending[step]
                continue
            later = any(s > step for s in pending)
            if not (final or later or (self._last_tags and self._last_tags <= tags.keys())):
                break
            out.append({"step": step, **tags})
            self._last, self._last_tags = step, frozenset(tags)
            del pending[step]
        return out

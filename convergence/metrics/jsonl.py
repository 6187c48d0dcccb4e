"""The JSONL metrics stream: one JSON object per line, ``{"step": 3, "loss": 2.31, ...}``.

Written live by the trainer (one flushed line per logged step), so a reader may meet a last line
that is still being written. Lines with an ``"event"`` key are annotations (restarts, stops),
not metrics. Python's ``json`` writes float64 as its shortest repr, so values round-trip exactly.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convergence.metrics.curve import Curve, RunMetrics
from convergence.metrics.tags import JSONL_KEYS, assemble, resolve_map


def read_jsonl(path: Path, key_map: Mapping[str, str] | None = None) -> RunMetrics:
    """All metric curves of a JSONL file.

    ``key_map`` maps the file's keys to ours (``{"train_loss": "loss"}``) for trainers that use
    their own names; keys already named as ours are read without it. A step logged twice (a
    resumed job) keeps its last value.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"metrics file {path} not found: the job wrote no metrics there; check the job's "
            f"log, and the backend's metrics_file option if it writes elsewhere"
        )
    source_map = resolve_map(JSONL_KEYS, key_map)
    pairs: dict[str, list[tuple[int, float]]] = {source: [] for source in source_map}
    for record in _records(path):
        step = _step_of(record)
        if step is None:
            continue
        for source, values in pairs.items():
            value = _number(record.get(source))
            if value is not None:
                values.append((step, value))
    return assemble(source_map, pairs)


#: The key prefix of the per-part grad norms the built-in trainer (and the torchtitan
#: backend's step log) writes beside ``grad_norm_parts``: ``grad_norm/attention.wq``, ...
PART_NORM_PREFIX = "grad_norm/"

#: The key prefix of a mixture-of-experts step's routing counts (the built-in trainer's
#: ``moe_tokens/<layer>.<expert>``: token assignments per expert per layer of the global batch;
#: convergence/trainer/moe.py), which the anchored check reads to tell a routing flip
#: (convergence/stats/routing_flips.py).
ROUTING_PREFIX = "moe_tokens/"


def read_part_norms(path: Path) -> RunMetrics:
    """The per-part grad norm curves of a JSONL file (``grad_norm/<part>`` -> its Curve), for
    the anchored check, which judges each part (convergence/stats/anchored.py); none when the
    file has none or does not exist. Not part of :func:`read_jsonl`'s metrics: no rule
    compares a part on its own over a whole run."""
    return read_prefixed(path, PART_NORM_PREFIX)


def read_prefixed(path: Path, *prefixes: str) -> RunMetrics:
    """The curves of a JSONL file whose keys start with one of ``prefixes`` (key -> its
    Curve); none when the file has none or does not exist."""
    path = Path(path)
    if not path.is_file():
        return {}
    pairs: dict[str, list[tuple[int, float]]] = {}
    for record in _records(path):
        step = _step_of(record)
        if step is None:
            continue
        for key, raw in record.items():
            value = _number(raw)
            if key.startswith(prefixes) and value is not None:
                pairs.setdefault(key, []).append((step, value))
    return {key: Curve.from_pairs(key, values) for key, values in pairs.items()}


def _records(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    lines = data.split(b"\n")
    # A last piece without its newline is complete only if it parses (a writer mid-line
    # leaves half an object: that is expected, not an error).
    tail = lines.pop()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        obj = _parse(line)
        if obj is None:
            # A crash mid-line followed by a resumed job appending gives one bad line in the
            # middle; the rest of the file is still good, so say so and read on.
            warnings.warn(
                f"{path}:{number}: not a JSON object, skipped: {line[:80]!r}", stacklevel=3
            )
            continue
        records.append(obj)
    if tail.strip():
        obj = _parse(tail)
        if obj is not None:
            records.append(obj)
    return records


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _step_of(record: Mapping[str, Any]) -> int | None:
    """The record's step, or None for annotations and records without one."""
    if "event" in record:
        return None
    step = _number(record.get("step"))
    if step is None or not math.isfinite(step) or step != int(step):
        return None
    return int(step)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class JsonlTail:
    """Returns the complete records appended to a growing JSONL file since the last poll.

    Keeps a byte offset; a last line without its newline is being written and is held back
    until it is complete. The file may not exist yet (the job has not started logging): that
    polls as no records. A file that shrank or was replaced (a restarted job) is read again
    from its start. A complete line that is not a JSON object is skipped: the watchdog must
    not die on one bad line.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self._inode: int | None = None

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:
                    self._inode, self._offset, self._partial = stat.st_ino, 0, b""
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return [obj for obj in map(_parse, lines) if obj is not None]

    def drain(self) -> list[dict[str, Any]]:
        """After the job ended: the same as a poll (a last line without newline is cut)."""
        return self.poll()

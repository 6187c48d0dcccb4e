"""A minimal JSONL tailer for the launcher's watchdog.

TODO: switch to ``convergence.metrics.jsonl.JsonlTail`` once it lands (same ``poll()`` API);
this private copy exists so the launcher does not depend on work in progress.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlTail:
    """Returns the complete new lines of a growing JSONL file on each :meth:`poll`.

    A last line without its newline is being written: it is kept for the next poll. A complete
    line that is not a JSON object is skipped (the trainer owns the format; the watchdog must
    not die on one bad line).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        records: list[dict[str, Any]] = []
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                records.append(obj)
        return records

"""How each rank of a job ended: the structured result a start leaves for the failure reader.

The warm agent (launch/warm_agent.py) writes it as JSON, ``<log_dir>/agent_result.json``, when
its last rank has exited: every rank with its pid and exit code, and which rank failed first
(the order in which the agent reaped them: exact, not whole seconds). A torchrun agent writes
no such file; launch/torchrun_report.py reads its printed report into the same
:class:`RankExits` (the adapter), so launch/failure.py has one shape to read.

A job folder's result is removed when a job starts in it (the launcher), so a stale one is
never read for a later run.
"""

from __future__ import annotations

import json
import signal as _signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULT_FILE = "agent_result.json"
"""In the job's log folder, beside ``launcher.log``."""

SCHEMA = 1


def signal_name(returncode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"``; None for a normal exit code."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return _signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@dataclass(frozen=True, kw_only=True)
class RankExit:
    """How one rank ended."""

    rank: int
    local_rank: int
    exitcode: int | None
    error_file: Path | None
    """Its torchelastic error file, when the rank wrote one (a ``@record`` entry point)."""
    signal: str | None
    host: str | None = None
    """The node the rank ran on."""
    pid: int | None = None
    ended_by_agent: bool = False
    """The agent signalled it (SIGTERM) after another rank had failed or the job was ended:
    never the root cause while a rank failed by itself."""

    @property
    def failed(self) -> bool:
        return self.exitcode is not None and self.exitcode != 0


@dataclass(frozen=True, kw_only=True)
class RankExits:
    """Every rank's end and the first failure (None when no rank failed)."""

    ranks: tuple[RankExit, ...]
    first_failure: RankExit | None

    @property
    def other_failures(self) -> list[RankExit]:
        first = self.first_failure
        return [r for r in self.ranks if r.failed and (first is None or r.rank != first.rank)]


def to_json(exits: RankExits) -> str:
    def one(r: RankExit) -> dict[str, Any]:
        return {
            "rank": r.rank,
            "local_rank": r.local_rank,
            "pid": r.pid,
            "exitcode": r.exitcode,
            "signal": r.signal,
            "error_file": None if r.error_file is None else str(r.error_file),
            "host": r.host,
            "ended_by_agent": r.ended_by_agent,
        }

    first = exits.first_failure
    data = {
        "schema": SCHEMA,
        "ranks": [one(r) for r in exits.ranks],
        "first_failure": None if first is None else first.rank,
    }
    return json.dumps(data, indent=1)


def write_result(path: Path, exits: RankExits) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_json(exits))
    tmp.replace(path)


def read_result(log_dir: Path) -> RankExits | None:
    """The job's structured result, or None (a torchrun start, or none was written)."""
    try:
        data = json.loads((log_dir / RESULT_FILE).read_text())
        ranks = tuple(
            RankExit(
                rank=int(r["rank"]),
                local_rank=int(r["local_rank"]),
                pid=None if r.get("pid") is None else int(r["pid"]),
                exitcode=None if r.get("exitcode") is None else int(r["exitcode"]),
                signal=r.get("signal"),
                error_file=None if not r.get("error_file") else Path(r["error_file"]),
                host=r.get("host"),
                ended_by_agent=bool(r.get("ended_by_agent")),
            )
            for r in data["ranks"]
        )
        first = data.get("first_failure")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    by_rank = {r.rank: r for r in ranks}
    return RankExits(ranks=ranks, first_failure=None if first is None else by_rank.get(int(first)))

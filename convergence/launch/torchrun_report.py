"""torchrun's printed failure report, read into :class:`~convergence.launch.rank_exits.RankExits`.

A torchrun agent leaves no structured result: what it says about its ranks is the "Root Cause
(first observed failure)" block it prints to its output (``<log_dir>/launcher.log``): global
rank, local rank, exit code / signal, error file, host (checked against torch 2.13). This
module is the adapter from that text to the shape the warm agent writes as JSON
(launch/rank_exits.py), so launch/failure.py reads one shape for both starts.
"""

from __future__ import annotations

import re
from pathlib import Path

from convergence.launch.rank_exits import RankExit, RankExits, signal_name

_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", re.M)
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(.*)$", re.M)
_PID_RE = re.compile(r"\(pid:\s*(\d+)\)")
_ERRFILE_RE = re.compile(r"^\s*error_file\s*:\s*(\S+)", re.M)
_HOST_RE = re.compile(r"^\s*host\s*:\s*(\S+)", re.M)
_SIGNAL_TEXT_RE = re.compile(r"\((SIG[A-Z0-9]+)\)")
_ENTRY_SPLIT = re.compile(r"^\s*\[\d+\]:\s*$", re.M)


def _parse_entry(block: str) -> RankExit | None:
    rank_m = _RANK_RE.search(block)
    if rank_m is None:
        return None
    exit_m = _EXIT_RE.search(block)
    exitcode = int(exit_m.group(1)) if exit_m else None
    file_m = _ERRFILE_RE.search(block)
    error_file = Path(file_m.group(1)) if file_m and file_m.group(1) != "<N/A>" else None
    # Only the exitcode line: a traceback further down may mention any signal.
    sig_m = _SIGNAL_TEXT_RE.search(exit_m.group(2)) if exit_m else None
    pid_m = _PID_RE.search(exit_m.group(2)) if exit_m else None
    sig = signal_name(exitcode) or (sig_m.group(1) if sig_m else None)
    host_m = _HOST_RE.search(block)
    return RankExit(
        rank=int(rank_m.group(1)),
        local_rank=int(rank_m.group(2)),
        exitcode=exitcode,
        error_file=error_file,
        signal=sig,
        host=host_m.group(1) if host_m else None,
        pid=int(pid_m.group(1)) if pid_m else None,
    )


def parse_failures(agent_log: str) -> tuple[RankExit | None, list[RankExit]]:
    """torchrun's root cause and every other failure of its last report."""
    idx = agent_log.rfind(_ROOT_CAUSE)
    if idx < 0:
        return None, []
    start = agent_log.rfind("Failures:", 0, idx)
    others = (
        [e for e in map(_parse_entry, _ENTRY_SPLIT.split(agent_log[start:idx])) if e is not None]
        if start >= 0
        else []
    )
    return _parse_entry(agent_log[idx:]), others


def parse_root_cause(agent_log: str) -> RankExit | None:
    """The rank that really failed first, from torchrun's last failure report.

    torchrun's "first observed failure" compares timestamps in whole seconds, so a rank the
    agent itself SIGTERMed after the real failure can tie and be named instead. A SIGTERMed
    root cause therefore gives way to another failure that was not a SIGTERM.
    """
    cause, others = parse_failures(agent_log)
    if cause is not None and cause.signal == "SIGTERM":
        real = [o for o in others if o.signal != "SIGTERM"]
        if real:
            return min(real, key=lambda o: (o.error_file is None, o.rank))
    return cause


def torchrun_exits(agent_log: str) -> RankExits | None:
    """The failed ranks of torchrun's last report (the ones that exited 0 are not listed
    there), or None when the output holds no report."""
    cause, others = parse_failures(agent_log)
    if cause is None:
        return None
    first = parse_root_cause(agent_log)
    listed = {r.rank: r for r in (cause, *others)}
    return RankExits(ranks=tuple(listed[k] for k in sorted(listed)), first_failure=first)

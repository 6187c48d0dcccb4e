"""Why did a job fail: which rank, which signal, which traceback.

Sources, best first (checked against torch 2.13):
1. torchrun's "Root Cause (first observed failure)" block in the agent's output
   (``<log_dir>/launcher.log``): global rank, local rank, exit code / signal, error file.
2. The rank's torchelastic error file (``error.json``): torchrun sets
   ``TORCHELASTIC_ERROR_FILE`` for every worker, but it is only written when the entrypoint is
   wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``.
3. The rank's own stderr, which ``--redirects 3`` puts in
   ``<log_dir>/ranks/<run_id>/attempt_<n>/<local_rank>/stderr.log``: the last Python traceback.
"""

from __future__ import annotations

import json
import re
import signal as _signal
from dataclasses import dataclass
from pathlib import Path

from convergence.launch.types import FailureInfo

_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", re.M)
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(.*)$", re.M)
_ERRFILE_RE = re.compile(r"^\s*error_file\s*:\s*(\S+)", re.M)
_HOST_RE = re.compile(r"^\s*host\s*:\s*(\S+)", re.M)
_SIGNAL_TEXT_RE = re.compile(r"\((SIG[A-Z0-9]+)\)")
_ENTRY_SPLIT = re.compile(r"^\s*\[\d+\]:\s*$", re.M)
_TRACEBACK_HEAD = "Traceback (most recent call last):"
_TAIL_LINES = 40


@dataclass(frozen=True, kw_only=True)
class RootCause:
    """The fields of torchrun's root-cause block."""

    rank: int
    local_rank: int
    exitcode: int | None
    error_file: Path | None
    signal: str | None
    host: str | None = None
    """The node the rank ran on (torchrun's ``host :`` line)."""


def signal_name(returncode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"``; None for a normal exit code."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return _signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _parse_entry(block: str) -> RootCause | None:
    rank_m = _RANK_RE.search(block)
    if rank_m is None:
        return None
    exit_m = _EXIT_RE.search(block)
    exitcode = int(exit_m.group(1)) if exit_m else None
    file_m = _ERRFILE_RE.search(block)
    error_file = Path(file_m.group(1)) if file_m and file_m.group(1) != "<N/A>" else None
    # Only the exitcode line: a traceback further down may mention any signal.
    sig_m = _SIGNAL_TEXT_RE.search(exit_m.group(2)) if exit_m else None
    sig = signal_name(exitcode) or (sig_m.group(1) if sig_m else None)
    host_m = _HOST_RE.search(block)
    return RootCause(
        rank=int(rank_m.group(1)),
        local_rank=int(rank_m.group(2)),
        exitcode=exitcode,
        error_file=error_file,
        signal=sig,
        host=host_m.group(1) if host_m else None,
    )


def parse_failures(agent_log: str) -> tuple[RootCause | None, list[RootCause]]:
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


def parse_root_cause(agent_log: str) -> RootCause | None:
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


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:[ ]?", re.M)


def last_traceback(text: str) -> str:
    """The last Python traceback in ``text`` (to the end), or "" if there is none.

    torch prefixes a rank's stderr lines with ``[rank1]: ``; the prefix is dropped so the
    traceback and its last line read as Python printed them."""
    text = _RANK_PREFIX.sub("", text)
    idx = text.rfind(_TRACEBACK_HEAD)
    return text[idx:].rstrip() + "\n" if idx >= 0 else ""


def error_file_traceback(path: Path) -> str:
    """The traceback a ``@record``-wrapped rank wrote to its torchelastic error file."""
    try:
        data = json.loads(_read(path))
        msg = data["message"]
        if isinstance(msg, dict):
            extra = msg.get("extraInfo", {})
            return str(extra.get("py_callstack") or msg.get("message", ""))
        return str(msg)
    except (ValueError, KeyError, TypeError):
        return ""


def rank_stderr_files(log_dir: Path, local_rank: int) -> list[Path]:
    """The rank's stderr logs, newest attempt last."""
    return sorted(
        (log_dir / "ranks").glob(f"*/attempt_*/{local_rank}/stderr.log"),
        key=lambda p: p.stat().st_mtime,
    )


def _rank_traceback(log_dir: Path, cause: RootCause) -> str:
    if cause.error_file is not None:
        text = error_file_traceback(cause.error_file)
        if text:
            return text
    for path in reversed(rank_stderr_files(log_dir, cause.local_rank)):
        text = _read(path)
        tb = last_traceback(text)
        if tb:
            return tb
        if text.strip():
            return "\n".join(text.rstrip().splitlines()[-_TAIL_LINES:]) + "\n"
    return ""


def _scan_ranks(log_dir: Path) -> tuple[int | None, str]:
    """No root-cause block: the first rank whose stderr holds a traceback of its own failure
    (a peer-gone error only when no rank has another)."""
    logs = sorted((log_dir / "ranks").glob("*/attempt_*/*/stderr.log"))
    found: list[tuple[int | None, str]] = [
        (int(path.parent.name), last_traceback(_read(path))) for path in logs
    ]
    found = [(rank, tb) for rank, tb in found if tb]
    own = [(rank, tb) for rank, tb in found if not is_peer_gone(tb)]
    return (own or found or [(None, "")])[0]


def _last_line(traceback: str) -> str:
    lines = [ln.strip() for ln in traceback.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


#: The last line of a rank that failed only because a peer was gone: gloo/NCCL/c10d errors
#: seen by every other rank after the real failure. Such a rank is never the one to blame
#: while another rank failed differently.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote (worker|process|peer)|"
    r"NCCL communicator was aborted|socket timeout|Connection refused|"
    r"DistNetworkError|DistBackendError: .*(closed|reset|timeout)",
    re.IGNORECASE,
)


def is_peer_gone(traceback: str) -> bool:
    """Whether a rank's traceback ends in "a peer went away" rather than its own fault."""
    return bool(_PEER_GONE.search(_last_line(traceback)))


def _first_own_failure(
    log_dir: Path, cause: RootCause, tb: str, others: list[RootCause]
) -> tuple[RootCause, str]:
    """torchrun names one rank of those that exited in the same second; when it names one
    that only lost its peer, blame a rank that failed by itself (e.g. raised in a hook)."""
    if cause.signal or not is_peer_gone(tb):
        return cause, tb
    for other in sorted(others, key=lambda o: o.rank):
        if other.signal or other.rank == cause.rank:
            continue
        other_tb = _rank_traceback(log_dir, other)
        if other_tb and not is_peer_gone(other_tb):
            return other, other_tb
    return cause, tb


def diagnose(
    log_dir: Path, *, name: str, returncode: int | None, direct: bool = False
) -> FailureInfo:
    """Build the :class:`FailureInfo` of a job that exited unsuccessfully by itself."""
    agent_log = _read(log_dir / "launcher.log")
    cause = None if direct else parse_root_cause(agent_log)
    if cause is not None:
        tb = _rank_traceback(log_dir, cause)
        cause, tb = _first_own_failure(log_dir, cause, tb, parse_failures(agent_log)[1])
        if cause.signal:
            hint = " (out of memory?)" if cause.signal == "SIGKILL" else ""
            message = f"job {name!r}: rank {cause.rank} was killed by {cause.signal}{hint}"
        else:
            what = _last_line(tb) or f"exit code {cause.exitcode}"
            message = f"job {name!r}: rank {cause.rank} failed: {what}"
        return FailureInfo(
            message=message, rank=cause.rank, signal=cause.signal, traceback=tb, node=cause.host
        )
    rank, tb = (None, "") if direct else _scan_ranks(log_dir)
    tb = tb or last_traceback(agent_log)
    sig = signal_name(returncode)
    where = f"rank {rank}" if rank is not None else ("process" if direct else "torchrun")
    if sig:
        message = f"job {name!r}: {where} was killed by {sig}"
    else:
        what = _last_line(tb) or f"exit code {returncode}"
        message = f"job {name!r}: {where} failed: {what} (see {log_dir / 'launcher.log'})"
    return FailureInfo(message=message, rank=rank, signal=sig, traceback=tb)


#: Signals a rank may die of in interpreter/C++ teardown once its work is done.
_TEARDOWN_SIGNALS = ("SIGABRT", "SIGSEGV")


def finished_then_aborted(
    failure: FailureInfo, *, last_step: int | None, total_steps: int | None
) -> bool:
    """A rank died of a teardown signal after the job had logged its last step.

    Why such a run is kept as finished: the logging rank writes the last step's metrics only
    after that step's collectives (loss and grad-norm reductions) completed on every rank, so
    every rank got through all its steps; what died is the process's exit path (gloo/c10d
    threads destroyed during interpreter finalization: "terminate called without an active
    exception"). Nothing after the last step feeds a verdict, and throwing the run away would
    turn a flake of the runtime into a lost result. A Python traceback, a plain non-zero exit
    code, or an unknown step count is never read as a teardown abort.
    """
    if total_steps is None or last_step is None or last_step < total_steps:
        return False
    if failure.signal not in _TEARDOWN_SIGNALS:
        return False
    return _TRACEBACK_HEAD not in failure.traceback


def note_in_launcher_log(log_dir: Path, message: str) -> None:
    """Append what the launcher decided about a job to its ``launcher.log`` (best effort): a
    reader of the logs sees why a run that did not exit cleanly was kept."""
    try:
        with open(log_dir / "launcher.log", "a", encoding="utf-8") as log:
            log.write(f"\n# convergence: {message}\n")
    except OSError:
        pass


def note_teardown_abort(log_dir: Path, failure: FailureInfo, *, steps: int | None) -> FailureInfo:
    """Record a teardown abort in ``launcher.log`` and return the note for the result."""
    where = f"rank {failure.rank}" if failure.rank is not None else "a rank"
    message = (
        f"{where} was killed by {failure.signal} at exit, after all {steps} steps were "
        "logged (teardown abort; the run is complete and kept)"
    )
    note_in_launcher_log(log_dir, message)
    return FailureInfo(
        message=message,
        rank=failure.rank,
        signal=failure.signal,
        traceback=failure.traceback,
        step=steps,
    )

"""Why did a job fail: which rank, which signal, which traceback.

Sources, best first (checked against torch 2.13):
1. How each rank ended (launch/rank_exits.py): the warm agent's structured result
   (``<log_dir>/agent_result.json``: every rank's exit code and the first failure, exact), or
   for a torchrun start its printed "Root Cause (first observed failure)" report, read into
   the same shape by the adapter launch/torchrun_report.py.
2. The rank's torchelastic error file (``error.json``): both starts set
   ``TORCHELASTIC_ERROR_FILE`` for every worker, but it is only written when the entrypoint is
   wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``.
3. The rank's own stderr, ``<log_dir>/ranks/<run_id>/attempt_<n>/<local_rank>/stderr.log``
   (torchrun's ``--redirects 3`` layout, which the warm agent keeps): the last Python
   traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from convergence.launch.rank_exits import RankExit, RankExits, read_result, signal_name
from convergence.launch.torchrun_report import torchrun_exits
from convergence.launch.types import FailureInfo

_TRACEBACK_HEAD = "Traceback (most recent call last):"
_TAIL_LINES = 40


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def rank_exits(log_dir: Path, agent_log: str) -> RankExits | None:
    """How the job's ranks ended: the structured result when the start wrote one (warm),
    else torchrun's printed report (the adapter), else None."""
    return read_result(log_dir) or torchrun_exits(agent_log)


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


def _rank_traceback(log_dir: Path, cause: RankExit) -> str:
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
    log_dir: Path, cause: RankExit, tb: str, others: list[RankExit]
) -> tuple[RankExit, str]:
    """The first rank seen to fail may only have lost its peer (torchrun names one of those
    that exited in the same second; a rank that raised may take longer to exit than the peer
    that saw its socket close): then blame a rank that failed by itself (e.g. raised in a
    hook)."""
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
    exits = None if direct else rank_exits(log_dir, agent_log)
    cause = None if exits is None else exits.first_failure
    if exits is not None and cause is not None:
        tb = _rank_traceback(log_dir, cause)
        cause, tb = _first_own_failure(log_dir, cause, tb, exits.other_failures)
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

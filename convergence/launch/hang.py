"""Which rank hung: said before the job is ended, while its processes can still be asked.

"No new metrics line for 15 s" says that a job hangs, not where. In a data-parallel job one
stuck rank stops every other rank at its next collective, so the question is which rank is
*not* waiting in a collective. Two cheap looks, both at kill time:

1. Process state: a rank that is stopped (SIGSTOP, a debugger) or a zombie is named at once.
2. Python stacks: a rank that registered a faulthandler dump on SIGUSR1 (the built-in trainer
   and every process leaving through ``convergence.dist_exit`` do) writes every thread's stack
   to its stderr log. We only send SIGUSR1 to processes whose signal mask says they catch it:
   its default action would kill the process. The rank whose main-thread stack has no frame
   inside ``torch/distributed`` is the suspect; its innermost frame of user code is named.

Neither look is needed for the verdict (the job is ended either way); they make the message
point at the rank and line to look at. A job launched under Slurm runs its ranks on other
nodes: there the same two looks run on each node inside the job's step (hang_probe.py), and the
rank is named with its node.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import psutil

DUMP_WAIT_S = 1.0
"""How long the ranks get to write their stacks (faulthandler writes synchronously, at once)."""

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _rank_of(proc: psutil.Process) -> int | None:
    try:
        rank = proc.environ().get("RANK")
    except psutil.Error:
        return None
    return int(rank) if rank is not None and rank.isdigit() else None


def rank_processes(processes: Iterable[psutil.Process]) -> dict[int, psutil.Process]:
    """The job's rank processes by global rank (those started with RANK in their environment
    whose parent is not itself a rank: a rank's own helpers inherit RANK too)."""
    procs = list(processes)
    pids = {p.pid for p in procs}
    ranks: dict[int, psutil.Process] = {}
    for proc in procs:
        rank = _rank_of(proc)
        if rank is None:
            continue
        try:
            parent = proc.ppid()
        except psutil.Error:
            continue
        if parent in pids and _rank_of(psutil.Process(parent)) is not None:
            continue
        ranks.setdefault(rank, proc)
    return ranks


def catches_signal(proc: psutil.Process, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (SigCgt in /proc/<pid>/status)."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


RankState = Literal["stopped", "zombie", "running"]


def rank_state(proc: psutil.Process) -> RankState | None:
    """How a rank process stands, as far as the kernel says: stopped (SIGSTOP or a debugger),
    a zombie (exited, not reaped), or running (it may still hang: only its stack tells);
    None when it is gone. The one reading of a rank's state, here and on Slurm nodes
    (hang_probe.py)."""
    try:
        status = proc.status()
    except psutil.Error:
        return None
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    if status == psutil.STATUS_ZOMBIE:
        return "zombie"
    return "running"


def _stopped(ranks: dict[int, psutil.Process]) -> list[str]:
    said = {
        "stopped": "is stopped (SIGSTOP or a debugger)",
        "zombie": "has exited but was not reaped",
    }
    out = []
    for rank, proc in sorted(ranks.items()):
        state = rank_state(proc)
        if state in said:
            out.append(f"rank {rank} (pid {proc.pid}) {said[state]}")
    return out


def _stderr_log(log_dir: Path, local_rank: int) -> Path | None:
    logs = sorted(
        (log_dir / "ranks").glob(f"*/attempt_*/{local_rank}/stderr.log"),
        key=lambda p: p.stat().st_mtime,
    )
    return logs[-1] if logs else None


_THREAD = re.compile(
    r"(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n"
    r"((?:[ \t]+File \".*\n?)+)"
)


def dumped_stacks(text: str) -> list[list[str]]:
    """Every thread stack (frame lines, innermost first) faulthandler wrote into ``text``.
    Each launch starts with fresh rank logs and SIGUSR1 is sent once, so these are the dump's;
    gloo's own threads run no Python and are not listed."""
    return [m.group(1).splitlines() for m in _THREAD.finditer(text)]


def suspect_frame(stacks: list[list[str]]) -> str | None:
    """None when a thread waits inside torch.distributed, else the innermost user frame of the
    first thread listed (the one that took the signal: the main thread, in a trainer)."""
    frames = [[m for m in map(_FRAME.match, stack) if m] for stack in stacks]
    if any("/torch/distributed/" in m["file"] for stack in frames for m in stack):
        return None
    first = frames[0] if frames else []
    for m in first:
        if "/site-packages/" not in m["file"] and "<frozen" not in m["file"]:
            return f"{m['file']}:{m['line']} in {m['func']}"
    return f"{first[0]['file']}:{first[0]['line']}" if first else "?"


def forked_ranks(processes: Iterable[psutil.Process], log_dir: Path) -> dict[int, psutil.Process]:
    """A warm job's ranks by global rank, from the list its agent wrote: a forked rank's
    ``/proc/<pid>/environ`` is its fork server's, without RANK (launch/forkserver.py)."""
    try:
        listed = json.loads((log_dir / "ranks" / "warm_ranks.json").read_text())
    except (OSError, ValueError):
        return {}
    by_pid = {p.pid: p for p in processes}
    return {
        int(info["rank"]): by_pid[int(pid)] for pid, info in listed.items() if int(pid) in by_pid
    }


def describe_hang(processes: Iterable[psutil.Process], log_dir: Path) -> str:
    """A sentence naming the hung rank(s), or '' when nothing more can be said."""
    procs = list(processes)
    ranks = forked_ranks(procs, log_dir) or rank_processes(procs)
    if not ranks:
        return ""
    stopped = _stopped(ranks)
    if stopped:
        return "; ".join(stopped)
    asked = [rank for rank, proc in ranks.items() if ask_for_stacks(proc)]
    if not asked:
        return ""
    time.sleep(DUMP_WAIT_S)
    outside: list[str] = []
    waiting: list[int] = []
    for rank in sorted(asked):
        local_rank = _local_rank(ranks[rank])
        if local_rank is None:  # a forked rank: its local rank is its rank (one node)
            local_rank = rank
        log = _stderr_log(log_dir, local_rank) if local_rank is not None else None
        stacks = dumped_stacks(log.read_text(errors="replace")) if log is not None else []
        if not stacks:
            continue
        where = suspect_frame(stacks)
        if where is None:
            waiting.append(rank)
        else:
            outside.append(f"rank {rank} is not in a collective: {where}")
    if not outside:
        return (
            f"every rank waits in a collective (stacks in {log_dir / 'ranks'})" if waiting else ""
        )
    return "; ".join(outside) + waiting_tail(waiting) + f" (stacks in {log_dir / 'ranks'})"


def ask_for_stacks(proc: psutil.Process) -> bool:
    """Signal a rank that has the stack-dump handler to dump its stacks; True if it was asked."""
    if not catches_signal(proc, signal.SIGUSR1):
        return False
    try:
        proc.send_signal(signal.SIGUSR1)
    except psutil.Error:
        return False
    return True


def waiting_tail(waiting: list[int]) -> str:
    """What follows the ranks outside a collective: the ranks that wait in one ("" if none)."""
    if len(waiting) == 1:
        return f"; rank {waiting[0]} waits in a collective"
    if waiting:
        return f"; ranks {', '.join(map(str, waiting))} wait in collectives"
    return ""


def _local_rank(proc: psutil.Process) -> int | None:
    try:
        value = proc.environ().get("LOCAL_RANK")
    except psutil.Error:
        return None
    return int(value) if value is not None and value.isdigit() else None

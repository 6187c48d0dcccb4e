"""Ending a job's whole process tree, workers in other sessions included.

torchrun's workers may call ``setsid`` (or be started in their own session by a trainer), so a
process-group kill of the agent would orphan them. We therefore work by PID: collect every
descendant *before* signalling (once the agent dies its children are re-parented to init and can
no longer be found from it), plus every descendant seen earlier while the job ran
(:class:`DescendantTracker`), so a worker that was already re-parented is still ended.

Processes are held as ``psutil.Process`` objects, not bare PIDs: psutil checks the creation time
before signalling, so a recycled PID of an unrelated process is never killed.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True, kw_only=True)
class TreeKill:
    """What :func:`terminate_tree` did."""

    root_returncode: int | None
    """Exit status of the root (negative = signal), None if it was already gone/unknown."""
    pids: frozenset[int]
    """Every PID that was part of the tree (root, descendants, tracked extras)."""
    survivors: frozenset[int]
    """PIDs still alive after SIGKILL and reaping (should always be empty)."""


def descendants(pid: int) -> list[psutil.Process]:
    """All live descendants of ``pid`` (recursive); empty if ``pid`` is gone."""
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
        return children
    except psutil.Error:
        return []


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has ended; it only waits to be reaped)."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def pid_alive(pid: int) -> bool:
    """Like :func:`is_alive` for a bare PID (for tests and reports)."""
    if pid <= 0:
        return False
    try:
        return is_alive(psutil.Process(pid))
    except psutil.Error:
        return False


class DescendantTracker:
    """Remembers every descendant of a root seen while polling (the safety net)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self._seen: dict[int, psutil.Process] = {}

    def poll(self) -> None:
        for proc in descendants(self.root_pid):
            self._seen.setdefault(proc.pid, proc)

    @property
    def processes(self) -> list[psutil.Process]:
        return list(self._seen.values())

    @property
    def pids(self) -> frozenset[int]:
        return frozenset(self._seen)


def _signal_all(procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass  # already gone (or PID recycled: psutil refuses, which is what we want)


def _root(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _reap_root(root: psutil.Process | None, timeout_s: float) -> int | None:
    if root is None:
        return None
    try:
        # For our own child this is waitpid(): it reaps the zombie and gives the exit status.
        code = root.wait(timeout=timeout_s)
        return int(code) if code is not None else None
    except (psutil.TimeoutExpired, psutil.Error, ChildProcessError):
        return None


def terminate_tree(
    pid: int, grace_s: float = 5.0, *, extra: Iterable[psutil.Process] = ()
) -> TreeKill:
    """End ``pid`` and everything below it; return when none of it is alive.

    1. collect all descendants of ``pid`` (plus ``extra``, e.g. a tracker's processes);
    2. SIGTERM the root only (torchrun forwards it to its workers and cleans up);
    3. wait up to ``grace_s`` for the root and every collected process to exit;
    4. SIGKILL every collected process still alive (by PID), including late children;
    5. reap and verify.
    """
    root = _root(pid)
    collected: dict[int, psutil.Process] = {p.pid: p for p in extra}
    collected.update({p.pid: p for p in descendants(pid)})
    if root is not None:
        _signal_all([root], signal.SIGTERM)
    everyone = [p for p in ([root] if root else []) + list(collected.values())]
    _, alive = psutil.wait_procs(everyone, timeout=max(grace_s, 0.0))
    if alive:
        # Children born during the grace period are collected too (root may still be alive).
        collected.update({p.pid: p for p in descendants(pid)})
        alive = [p for p in ([root] if root else []) + list(collected.values()) if is_alive(p)]
        _signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5.0)
    returncode = _reap_root(root, timeout_s=5.0)
    all_procs = ([root] if root else []) + list(collected.values())
    survivors = frozenset(p.pid for p in all_procs if is_alive(p))
    pids = frozenset(p.pid for p in all_procs) | {pid}
    return TreeKill(root_returncode=returncode, pids=pids, survivors=survivors)


def kill_leftovers(procs: Iterable[psutil.Process], grace_s: float = 1.0) -> frozenset[int]:
    """After a job ended by itself: end any tracked process still alive (e.g. a detached
    grandchild a rank started). Returns the PIDs that had to be ended."""
    alive = [p for p in procs if is_alive(p)]
    if not alive:
        return frozenset()
    _signal_all(alive, signal.SIGTERM)
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    _signal_all(still, signal.SIGKILL)
    psutil.wait_procs(still, timeout=5.0)
    return frozenset(p.pid for p in alive)

"""Ending a job from another thread: the cancel scope of jobs that run together.

A pair's independent jobs (the control and its twins) may run at once, each supervised by its
own thread (convergence/run/together.py). A signal (Ctrl-C, SIGTERM made KeyboardInterrupt)
reaches the main thread only, and the job threads must then end their jobs' process trees as
the main thread ends its own: the main thread sets the scope's event, and each job's
supervision loop, and a wait for devices, checks it and raises :class:`JobCancelled`, which
ends that job the way a KeyboardInterrupt does (launch/torchrun.py: the tree is terminated,
pids.json written).

The scope is a context variable, set by the job's thread: launchers need no new parameter and
a job run without a scope is never cancelled this way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_scope: ContextVar[threading.Event | None] = ContextVar("convergence_cancel", default=None)


class JobCancelled(BaseException):
    """The job was ended because its group was cancelled (a BaseException, like
    KeyboardInterrupt: no ``except Exception`` on the way may take it for a job failure)."""


@contextmanager
def cancel_scope(event: threading.Event) -> Iterator[None]:
    """Jobs started in this block end (raise :class:`JobCancelled`) once ``event`` is set."""
    token = _scope.set(event)
    try:
        yield
    finally:
        _scope.reset(token)


def check_cancelled(what: str) -> None:
    """Raise :class:`JobCancelled` if this thread's cancel scope was cancelled."""
    event = _scope.get()
    if event is not None and event.is_set():
        raise JobCancelled(f"{what}: cancelled (the session was interrupted)")

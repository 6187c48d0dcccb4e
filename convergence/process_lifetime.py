"""No job outlives the process that launched it: a parent-death signal (Linux).

Jobs run in their own session (so Ctrl-C in a terminal reaches pytest, which ends them in
order) and so are out of reach of any signal sent to pytest's process group. When pytest itself
dies without a chance to clean up (SIGKILL from the OOM killer or a CI runner's hard kill, an
xdist worker killed by its controller), only the kernel can still tell the job: with
``prctl(PR_SET_PDEATHSIG, sig)`` a process receives ``sig`` the moment its parent dies.

- The launcher sets SIGTERM on the torchrun agent (or ``srun``, or a direct command) in the
  child between fork and exec: torchrun and srun both answer SIGTERM by ending their ranks.
- The built-in trainer sets SIGKILL on itself, so its ranks also die if the agent is killed
  outright (then nobody is left to end them politely).

Why "the thread that forked" matters: Linux sends the signal when the *thread* that created the
child exits, not the process. We fork from the thread that runs the job and waits for it, which
outlives the job by construction.

On other systems these are no-ops; a session-start sweep of recorded jobs is the fallback there.

The other way round, a SIGTERM to us (``scancel``, a CI runner's timeout, ``kill``) must end the
jobs too: :func:`install_sigterm_interrupt` makes it raise KeyboardInterrupt, so the Ctrl-C path
that is already right runs (the launcher ends each job's process tree, every ``finally`` runs).
The plugin installs it for a pytest session, :func:`sigterm_as_interrupt` for a CLI command.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


# Loaded once in the parent: the child between fork and exec must not dlopen anything.
_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGKILL, *, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies.

    ``expected_parent``: if the parent is already gone (re-parented since fork), the signal
    would never come, so the process sends it to itself now. Returns whether it was set.
    """
    if _PRCTL is None:
        return False
    if _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def child_dies_with_us(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when we die.

    None where unsupported (pass it through: ``preexec_fn=None`` is Popen's default).
    """
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(sig, expected_parent=parent)

    return preexec


class _Sigterm:
    """The installed handler's state (one per process, like the handler)."""

    on_signal: Callable[[int], None] | None = None
    interrupted = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if _Sigterm.interrupted:
        return  # already stopping; SIGKILL still ends a stuck teardown, jobs die with us
    _Sigterm.interrupted = True
    if _Sigterm.on_signal is not None:
        _Sigterm.on_signal(signum)
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def install_sigterm_interrupt(on_signal: Callable[[int], None] | None = None) -> bool:
    """Make SIGTERM raise KeyboardInterrupt, as Ctrl-C does, when SIGTERM still has its default
    action (a handler the user or another plugin installed is left alone), and only in the
    main thread (the only one that can handle signals). ``on_signal(signum)`` runs first
    (e.g. pass the signal on to child processes). Later SIGTERMs are ignored while the first
    one stops us. Returns whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    _Sigterm.on_signal, _Sigterm.interrupted = on_signal, False
    signal.signal(signal.SIGTERM, _interrupt)
    return True


def restore_sigterm() -> None:
    """Put SIGTERM's default action back if our handler is installed (an in-process pytest
    run, e.g. pytester's ``runpytest``, must not leave it behind)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is _interrupt
    ):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """:func:`install_sigterm_interrupt` for the block (a CLI command): a killed ``convergence
    ab`` or ``bisect`` still stops its job and removes its worktrees. Python's default for
    SIGTERM is to die on the spot."""
    installed = install_sigterm_interrupt()
    try:
        yield
    finally:
        if installed:
            restore_sigterm()

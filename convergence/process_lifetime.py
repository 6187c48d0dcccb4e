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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

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

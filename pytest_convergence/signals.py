"""SIGTERM ends a session the way Ctrl-C does.

``scancel``, a CI runner's timeout and ``kill`` send SIGTERM, whose default action ends pytest
at once: no report, and the running job's torchrun agent -- in its own session, out of reach of
a signal to pytest's process group -- would go on training. Raising KeyboardInterrupt instead
reuses the Ctrl-C path that is already right: the launcher ends the job's process tree by PID,
pytest finishes as interrupted, and the controller writes the report marked interrupted with
every outcome it has. Under xdist every worker installs it too, and the controller forwards the
signal to its workers (a CI runner signals only the PID it started; ``scancel`` signals every
process of the step, so a worker may get it twice: later ones are ignored while it stops).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_state = {"forward": False, "interrupted": False}


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if _state["interrupted"]:
        return  # already stopping; SIGKILL still ends a stuck teardown, jobs die with us
    _state["interrupted"] = True
    if _state["forward"]:
        _forward_to_workers(signum)
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def _forward_to_workers(signum: int) -> None:
    """xdist controller: a CI runner signals only the PID it started, but the jobs run in the
    workers (our children), which wait on them and would never hear of it."""
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def sigterm_as_interrupt(*, forward_to_workers: bool = False) -> bool:
    """Install the handler when SIGTERM still has its default action (a handler the user or
    another plugin installed is left alone). Returns whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    _state.update(forward=forward_to_workers, interrupted=False)
    signal.signal(signal.SIGTERM, _interrupt)
    return True


def restore_sigterm() -> None:
    """Put the default action back at unconfigure (an in-process pytest run, e.g. pytester's
    ``runpytest``, must not leave its handler behind)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is _interrupt
    ):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

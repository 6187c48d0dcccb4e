"""SIGTERM ends a session the way Ctrl-C does.

``scancel``, a CI runner's timeout and ``kill`` send SIGTERM, whose default action ends pytest
at once: no report, and the running job's torchrun agent -- in its own session, out of reach of
a signal to pytest's process group -- would go on training. Raising KeyboardInterrupt instead
(:func:`convergence.process_lifetime.install_sigterm_interrupt`, also used by the CLI) reuses
the Ctrl-C path that is already right: the launcher ends the job's process tree by PID, pytest
finishes as interrupted, and the controller writes the report marked interrupted with every
outcome it has. Under xdist every worker installs it too, and the controller forwards the
signal to its workers (a CI runner signals only the PID it started; ``scancel`` signals every
process of the step, so a worker may get it twice: later ones are ignored while it stops).
"""

from __future__ import annotations

from convergence.process_lifetime import install_sigterm_interrupt, restore_sigterm

__all__ = ["interrupt_on_sigterm", "restore_sigterm"]


def _forward_to_workers(signum: int) -> None:
    """xdist controller: a CI runner signals only the PID it started, but the jobs run in the
    workers (our children), which wait on them and would never hear of it."""
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def interrupt_on_sigterm(*, forward_to_workers: bool = False) -> bool:
    """Install the session's SIGTERM handler (see the module docstring); returns whether it was
    installed (not when the user or another plugin has one)."""
    return install_sigterm_interrupt(_forward_to_workers if forward_to_workers else None)

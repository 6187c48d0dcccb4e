"""The one way a process that joined a ``torch.distributed`` process group leaves.

Why this exists: at interpreter finalization, gloo's worker threads, the c10d store's client
and DDP's reducer can still own C++ objects whose destructors need the GIL (or a thread that
is already gone) while Python is being torn down. The C++ runtime then aborts with
``terminate called without an active exception`` (SIGABRT) *after* the rank's work is done.
It is a race, so it shows up in a fraction of runs: a finished training run, a test fixture
worker or a benchmark worker is then reported as "rank N was killed by SIGABRT".

The cure is to never run finalization once the work is done: destroy the process group while
the interpreter is whole, flush what Python buffered, and leave with ``os._exit``. Everything a
caller wants on disk must be written and closed before (``os._exit`` skips ``atexit``,
``finally`` blocks of other threads and buffered file objects).

Use it as the entry point of any script that torchrun starts::

    from convergence.dist_exit import run_and_exit

    def main() -> int | None:
        dist.init_process_group("gloo")
        ...                       # work; write and close outputs
        return 0

    if __name__ == "__main__":
        run_and_exit(main)

Trainers of your own (the ``command`` backend) may use it too; it imports torch only when a
process group exists.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from convergence.phase_marks import mark


def _destroy_process_group() -> None:
    """Destroy the default process group if this process joined one (success path only)."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """Leave now with ``code``: process group destroyed (when ``code == 0``), stdio flushed,
    no interpreter finalization.

    On a failure (``code != 0``) the process group is *not* destroyed: a peer may be gone or
    stuck in a collective, and destroying a group with pending work can block; the exit code
    alone tells torchrun what happened.
    """
    if code == 0:
        try:
            _destroy_process_group()
        # A failed teardown must not turn a finished run into a crash.
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    mark("exit")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def _exit_code(value: object) -> int:
    """What ``sys.exit(value)`` would exit with."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and leave through :func:`exit_process` whatever happens.

    Return value and ``SystemExit`` give the exit code as ``sys.exit`` would; an exception
    prints its traceback to stderr (where torchrun's per-rank log and our failure diagnosis
    read it) and exits 1; Ctrl-C exits 130. A native crash (SIGSEGV, SIGABRT) prints every
    thread's Python stack first (faulthandler): without it only "killed by SIGSEGV" is known.
    """
    faulthandler.enable(all_threads=True)
    # and on SIGUSR1 (sent by our launcher to a hung job) too, without exiting: see
    # convergence/launch/hang.py
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        code = _exit_code(main())
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 -- any failure is printed, then exit with its code
        traceback.print_exc()
        code = 1
    exit_process(code)

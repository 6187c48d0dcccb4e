"""Independent jobs at once: one thread per job, each waiting for its own devices.

A pair's control-side jobs (the control and its twins, or its seed replicates) read nothing of
each other, yet ran one after another, so a bf16 twin pair cost three jobs of wall time before
its test started. Here each runs in its own thread; each leases its devices from the session's
pool as a lone job would (JobRunner.launch), so they overlap exactly as far as the pool has
room and queue behind each other when it has not: what the pool counts (ranks per CPU slot or
GPU) bounds the load, not this module.

What stays as it was:
- results come back in the order of the calls, whatever order the jobs end in;
- a failure is raised once every job ended (the finished ones are in the run cache): the
  first failure in call order, as running them in turn would have raised it;
- an interrupt (Ctrl-C, SIGTERM made KeyboardInterrupt) reaches the main thread, waiting
  here: it cancels the group (launch/cancel.py), every job thread ends its job's process tree,
  and the interrupt goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from convergence.launch.cancel import cancel_scope

T = TypeVar("T")

CANCEL_WAIT_S = 60.0
"""After an interrupt: how long the job threads get to end their jobs (a job's SIGTERM grace
is seconds). A thread still stuck (e.g. on another process's cache lock) is left behind: it is
a daemon, and what it could still start dies with this process (launch/forkserver.py)."""


def run_together(calls: Sequence[Callable[[], T]], *, together: bool = True) -> list[T]:
    """``[call() for call in calls]``, the calls run at once when ``together`` (see the module
    docstring); one call, or ``together`` False, runs in this thread."""
    if not together or len(calls) <= 1:
        return [call() for call in calls]
    cancel = threading.Event()
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def work(index: int, call: Callable[[], T]) -> None:
        with cancel_scope(cancel):
            try:
                results[index] = call()
            except BaseException as exc:  # noqa: BLE001 -- raised in the main thread below
                errors[index] = exc

    threads = [
        threading.Thread(target=work, args=(i, call), name=f"convergence-job-{i}", daemon=True)
        for i, call in enumerate(calls)
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:
        cancel.set()
        deadline = time.monotonic() + CANCEL_WAIT_S
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        raise
    for error in errors:
        if error is not None:
            raise error
    return results  # type: ignore[return-value]  # every call returned: no None is left

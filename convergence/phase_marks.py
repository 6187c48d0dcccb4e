"""Timestamps of a job's phases, for benchmarks/job_fixed_cost.py only (off unless asked).

When ``CONVERGENCE_PHASE_LOG`` names a file, :func:`mark` appends one line per call:
``<phase> <pid> <rank or -> <wall time.time()> <this process's CPU seconds>``; the launcher's
agents, the trainer's entry and its step loop mark where a job's fixed cost goes (imports,
rendezvous, set-up, steps, exit). Unset, a mark is one dictionary lookup. Lines are short
single ``write`` calls on a file opened for appending, so concurrent ranks do not interleave.
"""

from __future__ import annotations

import os
import resource
import time

ENV = "CONVERGENCE_PHASE_LOG"


def process_cpu_s(*, children: bool = False) -> float:
    """User + system CPU seconds of this process (and, with ``children``, of every child it
    has waited for)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    if children:
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += waited.ru_utime + waited.ru_stime
    return total


def process_start_time() -> float:
    """When this process was created (``time.time()`` scale; /proc, 10 ms resolution)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # proc(5) field 22: after boot
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)


def mark(phase: str, *, at: float | None = None, cpu_s: float | None = None) -> None:
    """Record that ``phase`` happened now (or ``at``) in this process; no-op unless enabled."""
    path = os.environ.get(ENV)
    if not path:
        return
    rank = os.environ.get("RANK", "-")
    cpu = process_cpu_s() if cpu_s is None else cpu_s
    line = f"{phase} {os.getpid()} {rank} {time.time() if at is None else at:.6f} {cpu:.4f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)

"""A job's effective train config, worked out once per job and process.

The *effective* train config is the backend's config with the job's settings applied: the
built-in trainer's TOML merged with the job's overrides (``BuiltinBackend.effective_config``),
torchtitan's parsed JobConfig (``TorchtitanBackend.effective_config``). Many questions about a
job are answered from it -- its preflight, its tokens per optimizer step, its noise twin (which
preflights the twin and compares its tokens), the batch fix a preflight error suggests, its seed
checkpoint's identity -- and they are asked at collection (preflight.py, the regime's checks,
the device check) and again by the session's runner (the regime's control jobs,
``JobRunner.prepare``). The answer cannot change within a session while the config file stays
as it is, so each backend's ``effective_config`` is wrapped in :func:`once_per_job`: the first
call works it out, every later one -- from any caller -- looks it up.

The memo lives as long as the process: a pytest session (controller or xdist worker) or a CLI
run, like the Runner (run/session.py). Its key is the backend, the job (a frozen, hashable
JobSpec) and the config file's stamp (modification time and size), so that a file rewritten
in place (a test, an editor between two runs of a long-lived process) is read again.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from convergence.spec.job import JobSpec


class _Named(Protocol):
    name: str


S = TypeVar("S", bound=_Named)
T = TypeVar("T")

Stamp = tuple[int, int] | None

_memo: dict[tuple[str, JobSpec, Stamp], Any] = {}

computed: Counter[tuple[str, JobSpec]] = Counter()
"""How many times each (backend, job)'s effective config was worked out in this process (1
once it has been: tests/test_pair_walk.py checks that a pair's checks and run ask no more)."""


def _stamp(job: JobSpec) -> Stamp:
    try:
        stat = os.stat(job.train_config)
    except OSError:  # torchtitan without a train_config file, or a shipped name
        return None
    return stat.st_mtime_ns, stat.st_size


def once_per_job(compute: Callable[[S, JobSpec], T]) -> Callable[[S, JobSpec], T]:
    """``compute(backend, job)`` worked out once per (backend name, job, file stamp).

    A failure (a SpecError for a bad override) is not kept: the next call raises it again."""

    @functools.wraps(compute)
    def lookup(backend: S, job: JobSpec) -> T:
        key = (backend.name, job, _stamp(job))
        if key in _memo:
            found: T = _memo[key]
            return found
        value = compute(backend, job)
        _memo[key] = value
        computed[backend.name, job] += 1
        return value

    return lookup

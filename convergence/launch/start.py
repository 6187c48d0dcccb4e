"""How a local job's processes start: the :class:`StartStrategy` protocol.

Two strategies, one file each: launch/start_torchrun.py (a torchrun agent per job) and
launch/start_warm.py (the job's ranks forked from the session's fork server). The local
launcher (launch/torchrun.py) picks one per job, starts it, then supervises the root process
it got back the same way whichever started it: progress, watchdog, hang detection, stop file,
cancellation and SIGTERM all live there, not here.
"""

from __future__ import annotations

import re
from typing import BinaryIO, Protocol

from convergence.launch.types import LaunchRequest

LAUNCHER_LOG = "launcher.log"
"""In the job's log folder: the agent's output (either start's), and the launcher's notes."""
RANKS_DIR = "ranks"
"""In the job's log folder: one folder of logs per rank, in torchrun's layout."""


def rdzv_id(name: str) -> str:
    """A job's run id (it names the per-rank log folder): its name, safe for a path."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:64] or "job"


class JobProcess(Protocol):
    """The root of a running job as the supervisor sees it: a torchrun agent's ``Popen`` or a
    warm agent's :class:`~convergence.launch.forkserver.WarmJob`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...


class StartFailed(RuntimeError):
    """The strategy could not start the job (not the job failing); the message says why. The
    launcher then starts it with torchrun: a job must not fail because its start-up could not
    be shortened."""


class StartStrategy(Protocol):
    """Starts one job's processes and names their root."""

    name: str
    """``warm`` or ``torchrun``: the progress line and the launcher's log say it."""

    def start(
        self, request: LaunchRequest, log: BinaryIO, *, argv: list[str], env: dict[str, str]
    ) -> JobProcess:
        """Start ``request``'s processes; ``log`` is its fresh ``launcher.log``, where the
        strategy writes what it starts (first line: ``# argv: [...]``). ``argv`` (the
        torchrun command) and ``env`` are the launcher's, worked out before the start (a
        subclass -- the Slurm launcher -- changes them), so a strategy never calls back into
        the launcher that called it. Raises :class:`StartFailed` when it cannot."""
        ...

    def reaped_returncode(self, proc: JobProcess, killed: int | None) -> int:
        """The root's exit status after the launcher ended its tree: ``killed`` (what
        terminate_tree reaped, None when the root was not its child), else what the strategy
        learns by itself, else -9."""
        ...

"""The torchrun start: one torchrun agent per job, a child of the launcher (launch/torchrun.py
explains its rendezvous and argv)."""

from __future__ import annotations

import signal
import subprocess
from typing import BinaryIO

from convergence.launch.start import JobProcess
from convergence.launch.types import LaunchRequest
from convergence.process_lifetime import child_dies_with_us


class TorchrunStart:
    """A :class:`~convergence.launch.start.StartStrategy`: ``argv`` and ``env`` are the
    launcher's (the Slurm launcher wraps the command in ``srun``; a job spanning nodes gets
    no loopback sockets)."""

    name = "torchrun"

    def start(
        self, request: LaunchRequest, log: BinaryIO, *, argv: list[str], env: dict[str, str]
    ) -> JobProcess:
        log.write(f"# argv: {argv!r}\n".encode())
        log.flush()
        # Its own session: the launcher ends the whole tree by PID (launch/process_tree.py);
        # it dies with us (parent-death SIGTERM) if the launcher's process is killed outright.
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=request.cwd,
            start_new_session=True,
            preexec_fn=child_dies_with_us(signal.SIGTERM),
        )

    def reaped_returncode(self, proc: JobProcess, killed: int | None) -> int:
        return killed if killed is not None else -9

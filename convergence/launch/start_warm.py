"""The warm start: the job's agent and ranks forked from the session's fork server
(launch/forkserver.py explains the processes, launch/warm_agent.py the agent)."""

from __future__ import annotations

import os
import time
from typing import BinaryIO

from convergence.launch.fork_servers import ForkServers
from convergence.launch.forkserver import ForkServer, ForkServerError, WarmJob
from convergence.launch.rank_exits import RESULT_FILE
from convergence.launch.start import LAUNCHER_LOG, RANKS_DIR, JobProcess, StartFailed, rdzv_id
from convergence.launch.types import LaunchRequest
from convergence.launch.warm_agent import WarmJobSpec


class WarmStart:
    """A :class:`~convergence.launch.start.StartStrategy` on ``servers`` (the session's)."""

    name = "warm"

    def __init__(
        self,
        *,
        python: str,
        servers: ForkServers,
    ) -> None:
        self.python = python
        self.servers = servers

    def server(self, request: LaunchRequest, env: dict[str, str]) -> ForkServer:
        """The server for ``request``'s import environment ``env`` (started now if there is
        none)."""
        return self.servers.server_for(
            self.python, env, str(request.cwd or os.getcwd()), imports=request.warm_imports
        )

    def start(
        self, request: LaunchRequest, log: BinaryIO, *, argv: list[str], env: dict[str, str]
    ) -> JobProcess:
        what = "1 process" if request.direct else f"{request.nproc} ranks"
        log.write(f"# argv: {[self.python, *request.entry]!r}\n".encode())
        log.write(f"# warm start: {what} forked (launch/forkserver.py)\n".encode())
        log.flush()  # the agent appends to the same file from now on
        spec = WarmJobSpec(
            name=request.name,
            entry=list(request.entry),
            nproc=request.nproc,
            env=env,
            cwd=str(request.cwd or os.getcwd()),
            launcher_log=str(request.log_dir / LAUNCHER_LOG),
            ranks_dir=str(request.log_dir / RANKS_DIR),
            run_id=rdzv_id(request.name),
            result_file=str(request.log_dir / RESULT_FILE),
            direct=request.direct,
        )
        try:
            return self.server(request, env).start_job(spec)
        except ForkServerError as exc:
            raise StartFailed(str(exc)) from exc

    def reaped_returncode(self, proc: JobProcess, killed: int | None) -> int:
        # The agent is the server's child, not ours: the server reports its status.
        if killed is None and isinstance(proc, WarmJob):
            killed = proc.wait_reported(2.0)
        return killed if killed is not None else -9

    def warm_up(self, request: LaunchRequest, env: dict[str, str]) -> tuple[float, float]:
        """Start the fork server for ``request`` (environment ``env``) now, as its first warm
        job would; returns its start's wall and CPU seconds (0, 0 when one was running)."""
        before = time.monotonic()
        server = self.server(request, env)
        fresh = time.monotonic() - before > 0.05
        return (server.start_wall_s, server.start_cpu_s) if fresh else (0.0, 0.0)

"""A CLI command ends the fork servers its session started (run/session.py: SessionRunner is a
context manager; launch/fork_servers.py). Real processes: ``convergence run`` on a command-backend
pair whose trainer starts warm, then psutil on the servers' pids once the command has returned.

The test holds each session's ForkServers (as a longer-lived caller would): a set that is only
collected would close its servers from its finalizer, which would hide a command that never
closes its session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

from convergence.cli import main
from convergence.launch.fork_servers import ForkServers
from convergence.launch.forkserver import ForkServer
from experiments import command_pair, fixture_command

pytestmark = pytest.mark.xdist_group("cli_fork_servers")


def test_convergence_run_leaves_no_fork_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[ForkServers] = []
    started: list[int] = []
    server_for = ForkServers.server_for

    def spy(self: ForkServers, *args: Any, **kwargs: Any) -> ForkServer:
        server = server_for(self, *args, **kwargs)
        held.append(self)
        started.append(server.proc.pid)
        return server

    monkeypatch.setattr(ForkServers, "server_for", spy)
    path = command_pair(tmp_path, command=fixture_command(), steps=3)
    code = main(["run", str(path), "--workdir", str(tmp_path / "wd")])
    assert code == 0
    assert started, "no job started warm: the test shows nothing"
    alive = [pid for pid in set(started) if psutil.pid_exists(pid)]
    assert not alive, f"fork server(s) {alive} outlived `convergence run`"
    assert all(servers.pids() == set() for servers in held)

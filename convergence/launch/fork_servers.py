"""A session's fork servers (launch/forkserver.py): started on first use, ended at its close.

Who owns one: the run session (``convergence.run.session.SessionRunner``: a pytest process --
controller or xdist worker -- or a CLI run) makes one, hands it to its launcher, and closes it
at the session's end (the plugin closes its session at ``pytest_unconfigure``). A server is
shared by the session's jobs whose interpreter, working folder and import environment match
(forkserver.import_env_key); a job that differs gets a server of its own.

A launcher built without one (a library user's ``LocalLauncher()``, a test's) shares
:func:`shared_fork_servers`, made on first use: without it every such launcher would pay the
server's imports again (seconds each). It is closed when the interpreter exits
(``weakref.finalize``), as is any set a caller forgot to close; a server would end anyway when
its launcher's process is gone (its stdin pipe closes), the finalizer only waits for it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType

from convergence.launch.forkserver import IMPORT_ENV_PREFIXES, ForkServer, import_env_key

ServerKey = tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]]


def _close_all(servers: dict[ServerKey, ForkServer], lock: threading.Lock) -> None:
    with lock:
        gone = list(servers.values())
        servers.clear()
    for server in gone:
        server.close()


class ForkServers:
    """The fork servers of one session, by interpreter and import environment."""

    def __init__(self) -> None:
        self._servers: dict[ServerKey, ForkServer] = {}
        self._lock = threading.Lock()
        # Not a method: the finalizer must not hold the object it finalizes.
        self._finalizer = weakref.finalize(self, _close_all, self._servers, self._lock)

    def server_for(
        self, python: str, env: Mapping[str, str], cwd: str, imports: Sequence[str] = ()
    ) -> ForkServer:
        """The server for jobs with this interpreter, folder, import environment and extra
        ``imports`` (LaunchRequest.warm_imports), started now when there is none, or the last
        one died. Jobs with other extra imports get another server: a builtin job's ranks
        never inherit a module its fresh process would not have imported."""
        key = (python, import_env_key(env, cwd), tuple(imports))
        with self._lock:
            server = self._servers.get(key)
            if server is not None and server.alive:
                return server
            server_env = {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES)}
            # The server's own environment matters only for what it imports; each job's ranks
            # get their whole environment from the job. PATH and HOME keep tools findable.
            for var in ("PATH", "HOME", "TMPDIR", "USER", "LANG"):
                if var in os.environ:
                    server_env.setdefault(var, os.environ[var])
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # what a look at it expects
                if var in env:
                    server_env[var] = env[var]
            server = ForkServer(python=python, env=server_env, cwd=cwd, imports=imports)
            self._servers[key] = server
            return server

    def pids(self) -> set[int]:
        """The live servers' own pids: they outlive jobs on purpose (one per session); what
        they fork for a job (agent, ranks) must not."""
        with self._lock:
            return {server.proc.pid for server in self._servers.values() if server.alive}

    def close(self) -> None:
        """End every server (and what they still run). The set stays usable: a later job
        starts a server again."""
        _close_all(self._servers, self._lock)

    def __enter__(self) -> ForkServers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_shared: ForkServers | None = None
_shared_lock = threading.Lock()


def shared_fork_servers() -> ForkServers:
    """The set for launchers built without a session's (see the module docstring)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ForkServers()
        return _shared

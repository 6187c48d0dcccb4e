"""One Runner per session (a pytest process -- controller or xdist worker -- or a CLI run).

The Runner holds what is costly to set up and right to share: device detection (imports
torch), the device pool, the run cache (its constructor sweeps stale temporary folders) and
the launcher (under Slurm, ``scontrol`` reads the allocation). It is built at the first pair,
not before: a pytest session with no convergence items never pays for it.

The session also owns its fork servers (launch/fork_servers.py: warm starts fork every job's
ranks from them): they are started by its first warm job and ended by :meth:`SessionRunner.close`
(the plugin closes the session at ``pytest_unconfigure``; a CLI command holds it in
``contextlib.closing``, so it closes when the command returns or raises; a session never closed
has them closed when it is collected or the interpreter exits: launch/fork_servers.py).
"""

from __future__ import annotations

from collections.abc import Callable

from convergence.launch.fork_servers import ForkServers
from convergence.launch.types import Launcher, Progress
from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner, RunSettings
from convergence.spec.errors import RunFailed
from convergence.spec.pair import PairSpec


class SessionRunner:
    """Runs every pair of a session through one lazily built :class:`Runner`."""

    def __init__(self, settings: RunSettings, *, launcher: Launcher | None = None) -> None:
        self.settings = settings
        self._launcher = launcher
        self._runner: Runner | None = None
        self.fork_servers = ForkServers()
        """This session's fork servers (none runs until a job starts warm)."""

    def runner(self) -> Runner:
        """The session's Runner, built on first use (raises CacheError when the cache cannot
        be opened; the next call tries again)."""
        if self._runner is None:
            self._runner = Runner(
                self.settings, launcher=self._launcher, fork_servers=self.fork_servers
            )
        return self._runner

    def close(self) -> None:
        """End the session's fork servers (and whatever they still run). A later pair would
        start them again."""
        self.fork_servers.close()

    def run_pair(
        self, pair: PairSpec, *, on_progress: Callable[[Progress], None] | None = None
    ) -> PairOutcome:
        """Run and judge ``pair``. Never raises for a run failure (RunFailed): it becomes
        status "error"; so does a cache that cannot be opened (e.g. a file where it needs a
        folder), for each pair until it can (the next pair tries again)."""
        try:
            runner = self.runner()
        except RunFailed as exc:  # CacheError
            return PairOutcome(pair=pair, status="error", control=None, test=None, error=str(exc))
        return runner.run_pair(pair, on_progress=on_progress)

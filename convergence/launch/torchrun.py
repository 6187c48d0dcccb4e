"""Run a job as a local ``torchrun`` subprocess, watch it, and never leave a process behind.

Rendezvous: ``--rdzv-backend c10d --rdzv-endpoint localhost:0`` is exactly what
``--standalone`` expands to in torch 2.13 (``torch/distributed/run.py``): the agent hosts the
c10d TCPStore on port 0, so the OS picks a free port atomically at bind time, and the workers
reuse that store (``TORCHELASTIC_USE_AGENT_STORE``) instead of probing for a second port. Many
jobs started at once therefore never race for a port (tested with 4 concurrent jobs). We spell
the options out so the rendezvous id can carry the job name (it names the per-rank log folder).

A one-node rendezvous runs torchrun through ``convergence.launch.loopback_torchrun`` (same
arguments), so that the agent's stores listen on 127.0.0.1 instead of every interface. The ranks'
own sockets follow ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``: a local job gets the
loopback interface in both unless the environment names one (without it gloo binds to the
address the hostname resolves to, which may be the machine's LAN address, and NCCL's bootstrap
to the first non-loopback interface).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from convergence.launch.cancel import check_cancelled
from convergence.launch.failure import (
    diagnose,
    finished_then_aborted,
    note_in_launcher_log,
    note_teardown_abort,
)
from convergence.launch.fork_servers import ForkServers, shared_fork_servers
from convergence.launch.forkserver import RANKS_FILE, warm_entry_problem
from convergence.launch.hang import describe_hang
from convergence.launch.process_tree import DescendantTracker, kill_leftovers, terminate_tree
from convergence.launch.rank_exits import RESULT_FILE
from convergence.launch.start import (
    LAUNCHER_LOG,
    RANKS_DIR,
    JobProcess,
    StartFailed,
    StartStrategy,
)
from convergence.launch.start import rdzv_id as _job_rdzv_id
from convergence.launch.start_torchrun import TorchrunStart
from convergence.launch.start_warm import WarmStart
from convergence.launch.types import (
    FailureInfo,
    JobResult,
    LaunchRequest,
    OnMetrics,
    OnProgress,
    Progress,
)
from convergence.launch.watch import JobWatch, Verdict

PIDS_FILE = "pids.json"
"""Written at the end of a job: the agent PID and every descendant PID seen (for audits)."""


def torchrun_module(rdzv_endpoint: str) -> str:
    """The module that runs torchrun: our wrapper for every rendezvous. It binds a local
    rendezvous's stores to loopback (other hosts' stores are created as torchrun would) and
    takes the agent's fixed costs off every job (loopback_torchrun's docstring)."""
    del rdzv_endpoint  # the wrapper decides per store; kept for the callers' one spelling
    return "convergence.launch.loopback_torchrun"


MONITOR_INTERVAL_S = 0.02
"""How often the torchrun agent looks at its workers (torch's default: 0.1 s). A job ends
when the agent sees its last rank exit; 20 ms polls of a few PIDs cost nothing measurable."""


def build_torchrun_argv(
    request: LaunchRequest,
    *,
    python: str = sys.executable,
    nnodes: int = 1,
    nproc_per_node: int | None = None,
    rdzv_endpoint: str = "localhost:0",
    rdzv_id: str | None = None,
) -> list[str]:
    """The argv that runs ``request`` (a list: never a shell string).

    The keyword options exist for multi-node launchers (Slurm): the defaults are the local,
    one-node rendezvous described in the module docstring."""
    if request.direct:
        return [python, *request.entry]
    return [
        python,
        "-m",
        torchrun_module(rdzv_endpoint),
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(request.nproc if nproc_per_node is None else nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        rdzv_id or _job_rdzv_id(request.name),
        "--log-dir",
        str(request.log_dir / RANKS_DIR),
        "--redirects",
        "3",  # per-rank stdout.log/stderr.log under --log-dir
        "--max-restarts",
        "0",  # a convergence run that restarts is not the run we compare
        "--monitor-interval",
        str(MONITOR_INTERVAL_S),
        *request.entry,
    ]


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo's and NCCL's own connections listen; a local job sets them to loopback."""


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return str(name)
    return "lo"


def local_job_env(request: LaunchRequest, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`job_env` for a job on this machine only: gloo and NCCL listen on loopback unless
    the environment already names an interface (README: Security model)."""
    env = job_env(request, base)
    for var in SOCKET_IFNAME_VARS:
        if not env.get(var):
            env[var] = loopback_interface()
    return env


def job_env(request: LaunchRequest, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` + ``request.env`` + unbuffered output and one OpenMP thread per rank
    unless the caller chose otherwise (many ranks share few cores here)."""
    env = dict(os.environ if base is None else base)
    env.update(request.env)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _write_pids(log_dir: Path, agent_pid: int, tracker: DescendantTracker) -> None:
    # A warm job's ranks as its agent listed them: a short job may end between two scans.
    # (Not signalled from here: they die with their agent, by parent-death SIGKILL.)
    try:
        listed = json.loads((log_dir / RANKS_DIR / RANKS_FILE).read_text())
    except (OSError, ValueError):
        listed = {}
    data = {"agent": agent_pid, "descendants": sorted(tracker.pids | {int(p) for p in listed})}
    (log_dir / PIDS_FILE).write_text(json.dumps(data))


STARTS = ("warm", "torchrun")
"""How a local job's processes start: ``warm`` forks the ranks from the session's fork server
(launch/start_warm.py; the default), ``torchrun`` runs a torchrun agent per job
(launch/start_torchrun.py)."""


class LocalLauncher:
    """The ``local`` launcher: a job's ranks on this machine, started warm (forked from the
    session's fork server) or by torchrun (see the module docstrings); either way supervised
    here, the same way."""

    name = "local"
    on_this_machine = True
    """Every rank runs on this machine: the job's sockets stay on loopback and its ranks may
    be forked warm. False for a launcher whose jobs span nodes (the Slurm launcher)."""

    def __init__(
        self,
        *,
        start: str = "warm",
        python: str = sys.executable,
        fork_servers: ForkServers | None = None,
        poll_interval_s: float = 0.02,
        stop_grace_s: float = 30.0,
        kill_grace_s: float = 5.0,
        progress_interval_s: float = 1.0,
        track_interval_s: float = 0.5,
    ) -> None:
        if start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {start!r}")
        self.start = start
        self.label = "torchrun" if self.name == "local" and start == "torchrun" else self.name
        """The launcher as the user chose it (``--convergence-launcher``), for the progress
        line: ``LocalLauncher(start="torchrun")`` is the ``torchrun`` launcher. A warm start's
        fallback keeps its ``local`` label (its launcher.log says why it used torchrun)."""
        self.python = python
        self.fork_servers = fork_servers if fork_servers is not None else shared_fork_servers()
        """Where warm starts fork from: the session's (it closes them at its end), else the
        process's shared set (launch/fork_servers.py)."""
        self.torchrun = TorchrunStart()
        self.warm = WarmStart(python=python, servers=self.fork_servers)
        self.poll_interval_s = poll_interval_s
        self.track_interval_s = track_interval_s
        """How often the descendant list is refreshed (a /proc scan: the supervisor's main CPU
        cost). terminate_tree collects again at kill time, so this only matters for processes
        that are re-parented away between two scans."""
        self.stop_grace_s = stop_grace_s
        """After touching the stop file: how long the trainer gets to exit by itself."""
        self.kill_grace_s = kill_grace_s
        """After SIGTERM: how long before every process of the tree gets SIGKILL."""
        self.progress_interval_s = progress_interval_s

    def job_env(self, request: LaunchRequest) -> dict[str, str]:
        """The job's environment: on this machine only, gloo and NCCL listen on loopback; a
        job spanning nodes gets the plain :func:`job_env`."""
        return local_job_env(request) if self.on_this_machine else job_env(request)

    def strategy(self, request: LaunchRequest) -> StartStrategy:
        """How ``request`` starts: warm unless :meth:`warm_problem` says why not."""
        return self.warm if self.warm_problem(request) is None else self.torchrun

    def launch(
        self,
        request: LaunchRequest,
        *,
        on_metrics: OnMetrics | None = None,
        on_progress: OnProgress | None = None,
    ) -> JobResult:
        check_cancelled(request.name)  # a group interrupted before this job started
        request.log_dir.mkdir(parents=True, exist_ok=True)
        # One launch = one set of logs: an earlier attempt's rank logs, structured result or
        # root-cause report in the same folder would be mistaken for this run's.
        shutil.rmtree(request.log_dir / RANKS_DIR, ignore_errors=True)
        (request.log_dir / RESULT_FILE).unlink(missing_ok=True)
        if request.stop_file is not None:
            request.stop_file.unlink(missing_ok=True)  # a stale one would stop us at step 1
        start = time.monotonic()
        strategy, proc = self._start(request)
        # The watchdog's clock starts once the job's processes exist: a warm start's first job
        # also starts its fork server (torch imported, ~3 CPU s; far more on a loaded 2-core
        # machine with several servers starting at once), which is not the job hanging. That
        # start has its own deadline (launch/forkserver.py).
        started = time.monotonic()
        tracker = DescendantTracker(proc.pid)
        if on_progress is not None:  # the start-up is silent for seconds
            what = "1 process" if request.direct else f"{request.nproc} ranks"
            warm = ", warm" if strategy.name == "warm" else ""
            on_progress(
                Progress(
                    name=request.name,
                    step=0,
                    total_steps=request.total_steps,
                    loss=None,
                    elapsed_s=0.0,
                    note=f"starting ({what}, {self.label} launcher{warm})",
                )
            )
        watch = JobWatch(
            request,
            start=started,
            on_metrics=on_metrics,
            on_progress=on_progress,
            progress_interval_s=self.progress_interval_s,
        )
        try:
            status, returncode, failure = self._supervise(strategy, proc, tracker, watch)
        except BaseException as exc:
            # KeyboardInterrupt, a cancelled group (launch/cancel.py) or a raising callback:
            # end the tree, then let it propagate.
            tracker.poll()  # every rank in pids.json, even one born after the last scan
            kill = terminate_tree(proc.pid, self.kill_grace_s, extra=tracker.processes)
            if proc.returncode is None:
                proc.returncode = strategy.reaped_returncode(proc, kill.root_returncode)
            _write_pids(request.log_dir, proc.pid, tracker)
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            note_in_launcher_log(request.log_dir, f"the job was ended ({why})")
            raise
        kill_leftovers(tracker.processes)
        _write_pids(request.log_dir, proc.pid, tracker)
        return JobResult(
            name=request.name,
            status=status,
            returncode=returncode,
            wall_s=time.monotonic() - start,
            log_dir=request.log_dir,
            metrics_path=request.metrics_path,
            failure=failure,
            last_step=watch.last_step,
        )

    def _start(self, request: LaunchRequest) -> tuple[StartStrategy, JobProcess]:
        """Start the job with its strategy; a warm start that fails (the fork server did not
        start or answer) falls back to torchrun, its reason kept in the job's launcher.log."""
        strategy = self.strategy(request)
        argv, env = self.build_argv(request), self.job_env(request)
        try:
            with open(request.log_dir / LAUNCHER_LOG, "wb") as log:
                return strategy, strategy.start(request, log, argv=argv, env=env)
        except StartFailed as exc:
            if strategy is self.torchrun:
                raise
            note_in_launcher_log(request.log_dir, f"{exc}; starting with torchrun instead")
        with open(request.log_dir / LAUNCHER_LOG, "ab") as log:  # after the note
            return self.torchrun, self.torchrun.start(request, log, argv=argv, env=env)

    def name_hung_rank(
        self, verdict: Verdict, tracker: DescendantTracker, request: LaunchRequest
    ) -> Verdict:
        """Add which rank hangs (and where) to a hung verdict; the Slurm launcher asks the
        nodes instead (its ranks are not local processes)."""
        return _name_hung_rank(verdict, tracker, request.log_dir)

    def build_argv(self, request: LaunchRequest) -> list[str]:
        """The command of one job; a subclass (the Slurm launcher) wraps it in ``srun``."""
        return build_torchrun_argv(request, python=self.python)

    def warm_problem(self, request: LaunchRequest) -> str | None:
        """Why ``request`` goes through torchrun rather than a warm start, or None."""
        if self.start != "warm" or not self.on_this_machine:
            return f"the {self.name} launcher starts {self.start}"
        if request.direct and not request.forkable:
            return "a direct command that is not forkable starts fresh (LaunchRequest.forkable)"
        return warm_entry_problem(request.entry)

    def warm_up(self, request: LaunchRequest | None = None) -> tuple[float, float]:
        """Start the fork server now (a session's first warm job would); returns its start's
        wall and CPU seconds (0, 0 when one was already running)."""
        probe = request or LaunchRequest(name="warm-up", entry=["-m", "x"], nproc=1, log_dir=Path())
        return self.warm.warm_up(probe, self.job_env(probe))

    def close(self) -> None:
        """End the fork servers this launcher's warm starts use (the session's, or the shared
        set: either starts a server again if a later job needs one)."""
        self.fork_servers.close()

    def _supervise(
        self, strategy: StartStrategy, proc: JobProcess, tracker: DescendantTracker, watch: JobWatch
    ) -> tuple[str, int | None, FailureInfo | None]:
        verdict: Verdict | None = None
        stop_deadline: float | None = None
        tracked_at = -float("inf")
        while proc.poll() is None:
            # Its group interrupted (launch/cancel.py): ends the tree as a KeyboardInterrupt does.
            check_cancelled(watch.request.name)
            now = time.monotonic()
            if now - tracked_at >= self.track_interval_s:
                tracker.poll()
                tracked_at = now
            new = watch.poll(now)
            if new is not None and verdict is None:
                verdict = new
                if new.status == "stopped_early" and watch.request.stop_file is not None:
                    watch.request.stop_file.touch()  # ask politely, then wait a grace period
                    stop_deadline = now + self.stop_grace_s
                else:
                    stop_deadline = now
            if stop_deadline is not None and now >= stop_deadline:
                assert verdict is not None
                if verdict.status == "hung":  # name the rank while it can still be asked
                    verdict = self.name_hung_rank(verdict, tracker, watch.request)
                tracker.poll()  # every rank in pids.json, even one born after the last scan
                kill = terminate_tree(proc.pid, self.kill_grace_s, extra=tracker.processes)
                # terminate_tree reaped the agent (waitpid); tell the Popen object so it does not
                # wait again (it would read the status as 0) or warn that it is still running.
                proc.returncode = strategy.reaped_returncode(proc, kill.root_returncode)
                if verdict.status == "ok" and verdict.failure is not None:  # ended, run kept
                    note_in_launcher_log(watch.request.log_dir, verdict.failure.message)
                return verdict.status, proc.returncode, verdict.failure
            time.sleep(self.poll_interval_s)
        return self._exited(proc, watch, verdict)

    def _exited(
        self, proc: JobProcess, watch: JobWatch, verdict: Verdict | None
    ) -> tuple[str, int | None, FailureInfo | None]:
        """The process ended by itself (perhaps after we asked it to stop)."""
        returncode = proc.returncode
        late = watch.finish(time.monotonic())
        if verdict is not None and verdict.status == "stopped_early" and returncode == 0:
            return "stopped_early", returncode, None
        if late is not None:
            return late.status, returncode, late.failure
        if returncode == 0:
            return "ok", returncode, None
        req = watch.request
        failure = diagnose(req.log_dir, name=req.name, returncode=returncode, direct=req.direct)
        if finished_then_aborted(failure, last_step=watch.last_step, total_steps=req.total_steps):
            # Kept, not thrown away: see finished_then_aborted. The failure stays attached to
            # the ok result so the runner and the logs can say what happened.
            return (
                "ok",
                returncode,
                note_teardown_abort(req.log_dir, failure, steps=req.total_steps),
            )
        return ("killed" if failure.signal else "failed"), returncode, failure


def _name_hung_rank(verdict: Verdict, tracker: DescendantTracker, log_dir: Path) -> Verdict:
    """Add which rank hangs (and where) to a hung verdict's message (launch/hang.py)."""
    tracker.poll()
    try:
        detail = describe_hang(tracker.processes, log_dir)
    except Exception as exc:  # noqa: BLE001 -- diagnosis only: never let it keep a hung job alive
        detail = f"(could not inspect the ranks: {exc})"
    if not detail or verdict.failure is None:
        return verdict
    failure = dataclasses.replace(verdict.failure, message=f"{verdict.failure.message}; {detail}")
    return dataclasses.replace(verdict, failure=failure)

"""One warm job's agent: torchrun's stand-in for one node, forked from the fork server.

It runs in the forked child of the server (convergence/launch/forkserver.py explains the
process tree) and does for one job what a one-node torchrun agent does, with the ranks forked
instead of started: a c10d store on 127.0.0.1, torchrun's environment per rank (what a
torch entry point reads: RANK, WORLD_SIZE, MASTER_PORT, ...), per-rank log files in torchrun's
layout, and the other ranks ended when one fails. How each rank ended is written as JSON
(launch/rank_exits.py: ``agent_result.json`` in the job's folder), which launch/failure.py
reads first; the job's ``launcher.log`` gets one line for a reader. A direct job (one process of ours, the
seed checkpoint: ``LaunchRequest.forkable``) has no ranks: the agent runs its command itself,
with the job's environment, its output in ``launcher.log`` as a fresh process's would be.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from convergence.dist_exit import run_and_exit
from convergence.launch.rank_exits import (
    RESULT_FILE,
    RankExit,
    RankExits,
    signal_name,
    write_result,
)
from convergence.phase_marks import mark, process_cpu_s
from convergence.process_lifetime import die_with_parent

POLL_S = 0.01
"""How often the agent looks for exited ranks (a waitpid; the job ends when the last has)."""
FAILED_RANKS_GRACE_S = 5.0
"""After a rank failed, the others get this long to exit on SIGTERM before SIGKILL."""


@dataclass(frozen=True, kw_only=True)
class WarmJobSpec:
    """What the agent needs to run one job (sent to the server as JSON)."""

    name: str
    entry: Sequence[str]
    nproc: int
    env: Mapping[str, str]
    cwd: str
    launcher_log: str
    ranks_dir: str
    run_id: str
    result_file: str = ""
    """Where the agent writes how each rank ended (launch/rank_exits.py); "" writes none."""
    direct: bool = False
    """A one-process command (LaunchRequest.direct, forkable): the agent runs it itself, with
    the job's environment only (no ranks, no store), as a fresh ``python <entry>`` would."""

    def to_json(self) -> str:
        data = {**self.__dict__, "entry": list(self.entry), "env": dict(self.env)}
        return json.dumps(data)


def _reset_signals() -> None:
    """What a fresh interpreter has: the server's own handlers must not reach a job."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    if faulthandler.is_enabled():
        faulthandler.disable()


def _redirect(fd: int, path: Path) -> None:
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, fd)
    os.close(out)


def _bind_store_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def rank_env(spec: WarmJobSpec, *, rank: int, port: int, error_file: Path) -> dict[str, str]:
    """The environment torchrun (torch 2.13, one node, agent store) gives a worker."""
    env = dict(spec.env)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            "WORLD_SIZE": str(spec.nproc),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(spec.nproc),
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": spec.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": str(error_file),
        }
    )
    return env


def _set_environ(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def run_entry(entry: list[str]) -> int | None:
    """Run ``python <entry>`` in this process, as the interpreter would (``__main__``, argv,
    ``sys.path[0]``)."""
    import runpy

    if entry[0] == "-m":
        module, args = entry[1], entry[2:]
        sys.argv = [module, *args]  # runpy replaces argv[0] with the module's file
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = entry[0], entry[1:]
        sys.argv = [script, *args]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]
        runpy.run_path(script, run_name="__main__")
    return None


def rank_folder(spec: WarmJobSpec, rank: int) -> Path:
    """A rank's log folder, in torchrun's layout (launch/failure.py finds its stderr there)."""
    return Path(spec.ranks_dir) / f"{spec.run_id}_warm" / "attempt_0" / str(rank)


def _rank_main(spec: WarmJobSpec, rank: int, port: int, agent: int) -> NoReturn:
    """A forked rank: logs, environment, then the job's entry; never returns."""
    die_with_parent(signal.SIGKILL, expected_parent=agent)
    folder = rank_folder(spec, rank)
    folder.mkdir(parents=True, exist_ok=True)
    _redirect(1, folder / "stdout.log")
    _redirect(2, folder / "stderr.log")
    _set_environ(rank_env(spec, rank=rank, port=port, error_file=folder / "error.json"))
    _run_entry_and_exit(spec)


def _run_entry_and_exit(spec: WarmJobSpec) -> NoReturn:
    """The job's entry in this process, with the torch threads its environment asks for (the
    server imported torch under its own), then leave (dist_exit.run_and_exit)."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp and omp.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(omp))
    run_and_exit(lambda: run_entry(list(spec.entry)))


def run_agent(spec: WarmJobSpec, *, server_pid: int) -> int:
    """The agent's life: fork the ranks, host their store, wait, report; the exit code."""
    os.setsid()  # a session of its own, as a torchrun agent started by the launcher has
    die_with_parent(signal.SIGTERM, expected_parent=server_pid)
    _reset_signals()
    os.chdir(spec.cwd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _redirect(1, Path(spec.launcher_log))
    _redirect(2, Path(spec.launcher_log))
    _set_environ(dict(spec.env))
    mark("agent_imported")
    if spec.direct:
        print(
            f"# warm agent: pid {os.getpid()} forked from the fork server (pid {server_pid}) "
            "runs the command itself",
            flush=True,
        )
        _run_entry_and_exit(spec)
    ranks_dir = Path(spec.ranks_dir)
    ranks_dir.mkdir(parents=True, exist_ok=True)
    sock = _bind_store_socket()
    port = sock.getsockname()[1]
    agent = os.getpid()
    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(spec.nproc):
        pid = os.fork()
        if pid == 0:
            sock.close()
            try:
                _rank_main(spec, rank, port, agent)
            finally:
                os._exit(1)
        ranks[pid] = rank
    (ranks_dir / "warm_ranks.json").write_text(
        json.dumps({str(pid): {"rank": r, "local_rank": r} for pid, r in ranks.items()})
    )
    print(
        f"# warm agent: {spec.nproc} ranks forked, pids {sorted(ranks)}; their store on "
        f"127.0.0.1:{port} (bound to port 0: the OS picked it)",
        flush=True,
    )
    store = _host_store(sock, port)
    code = _wait_ranks(spec, ranks)
    del store
    mark("agent_exit", cpu_s=process_cpu_s(children=True))
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _host_store(sock: socket.socket, port: int) -> Any:
    """The job's c10d store, on the socket bound before the ranks were forked (so none of
    them inherits the store's threads or connections)."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        "localhost",
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.fileno(),
        wait_for_workers=False,
    )


_terminating = False


def _on_term(signum: int, frame: Any) -> None:
    global _terminating
    _terminating = True


def _wait_ranks(spec: WarmJobSpec, ranks: dict[int, int]) -> int:
    """Wait for every rank; when one fails, end the others (torchrun's policy). SIGTERM to the
    agent ends the ranks (SIGTERM, then SIGKILL after a grace) and the agent. How each rank
    ended is written to ``spec.result_file`` (launch/rank_exits.py)."""
    signal.signal(signal.SIGTERM, _on_term)
    live = dict(ranks)
    exits: dict[int, tuple[int, int]] = {}  # rank -> (pid, exit code), in the order reaped
    ending_at: float | None = None
    ended: set[int] = set()  # ranks the agent signalled, before they exited by themselves
    while live:
        if _terminating and ending_at is None:
            ended |= set(live.values())
            _signal(live, signal.SIGTERM)
            ending_at = time.monotonic()
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if ending_at is not None and time.monotonic() - ending_at > FAILED_RANKS_GRACE_S:
                _signal(live, signal.SIGKILL)
            time.sleep(POLL_S)
            continue
        rank = live.pop(pid, None)
        if rank is None:
            continue
        exits[rank] = (pid, os.waitstatus_to_exitcode(status))
        if exits[rank][1] != 0 and ending_at is None:
            ended |= set(live.values())
            _signal(live, signal.SIGTERM)
            ending_at = time.monotonic()
    result = _rank_exits(spec, exits, ended)
    if spec.result_file:
        write_result(Path(spec.result_file), result)
    if _terminating:
        return 128 + signal.SIGTERM
    if result.first_failure is not None:
        print(_summary(result), file=sys.stderr, flush=True)
        return 1
    return 0


def _signal(live: dict[int, int], sig: int) -> None:
    for pid in live:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _rank_exits(spec: WarmJobSpec, exits: dict[int, tuple[int, int]], ended: set[int]) -> RankExits:
    """Every rank's end; the first failure is the first rank reaped with a non-zero exit code
    that the agent had not ended itself."""
    host = socket.gethostname()
    ranks: list[RankExit] = []
    for rank, (pid, code) in exits.items():  # the order reaped
        error_file = rank_folder(spec, rank) / "error.json"
        ranks.append(
            RankExit(
                rank=rank,
                local_rank=rank,
                pid=pid,
                exitcode=code,
                signal=signal_name(code),
                error_file=error_file if error_file.exists() else None,
                host=host,
                ended_by_agent=rank in ended,
            )
        )
    failed = [r for r in ranks if r.failed]
    first = next((r for r in failed if not r.ended_by_agent), failed[0] if failed else None)
    return RankExits(ranks=tuple(sorted(ranks, key=lambda r: r.rank)), first_failure=first)


def _summary(result: RankExits) -> str:
    """A reader's line in launcher.log (the launcher reads the JSON, not this)."""
    first = result.first_failure
    assert first is not None
    how = ", ".join(
        f"rank {r.rank} (pid {r.pid}) exit code {r.exitcode}"
        + (" (signalled by the agent)" if r.ended_by_agent else "")
        for r in result.ranks
    )
    return (
        f"# warm agent: rank {first.rank} failed first (exit code {first.exitcode}); {how}; "
        f"see {RESULT_FILE}"
    )

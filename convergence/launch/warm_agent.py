"""One warm job's agent: torchrun's stand-in for one node, forked from the fork server.

It runs in the forked child of the server (convergence/launch/forkserver.py explains the
process tree) and does for one job what a one-node torchrun agent does, with the ranks forked
instead of started: a c10d store on 127.0.0.1, torchrun's environment per rank, per-rank log
files in torchrun's layout, the other ranks ended when one fails, and torchrun's failure
report on its own stderr (the job's ``launcher.log``). A direct job (one process of ours, the
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


def _rank_main(spec: WarmJobSpec, rank: int, port: int, agent: int) -> NoReturn:
    """A forked rank: logs, environment, then the job's entry; never returns."""
    die_with_parent(signal.SIGKILL, expected_parent=agent)
    folder = Path(spec.ranks_dir) / f"{spec.run_id}_warm" / "attempt_0" / str(rank)
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
    agent ends the ranks (SIGTERM, then SIGKILL after a grace) and the agent."""
    signal.signal(signal.SIGTERM, _on_term)
    live = dict(ranks)
    failures: list[tuple[float, int, int, int]] = []  # (time, rank, pid, exit code)
    ending_at: float | None = None
    while live:
        if _terminating and ending_at is None:
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
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures.append((time.time(), rank, pid, code))
            if ending_at is None:
                _signal(live, signal.SIGTERM)
                ending_at = time.monotonic()
    if _terminating:
        return 128 + signal.SIGTERM
    if failures:
        print(_report(spec, failures), file=sys.stderr, flush=True)
        return 1
    return 0


def _signal(live: dict[int, int], sig: int) -> None:
    for pid in live:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _entry_text(when: float, spec: WarmJobSpec, rank: int, pid: int, code: int) -> str:
    folder = Path(spec.ranks_dir) / f"{spec.run_id}_warm" / "attempt_0" / str(rank)
    error_file = folder / "error.json"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else ""
        trace = f"Signal {-code} ({name}) received by PID {pid}"
    else:
        trace = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    return (
        f"[{rank}]:\n"
        f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}\n"
        f"  host      : {socket.gethostname()}\n"
        f"  rank      : {rank} (local_rank: {rank})\n"
        f"  exitcode  : {code} (pid: {pid})\n"
        f"  error_file: {error_file if error_file.exists() else '<N/A>'}\n"
        f"  traceback : {trace}\n"
    )


def _report(spec: WarmJobSpec, failures: list[tuple[float, int, int, int]]) -> str:
    """torchrun's failure report (launch/failure.py parses it): the first failure observed is
    the root cause, the others are listed above it."""
    (first, *others) = failures
    bar = "=" * 56
    lines = [bar, f"{spec.entry[-1] if spec.entry else ''} FAILED", "-" * 56, "Failures:"]
    if others:
        lines += [
            _entry_text(f[0], spec, *f[1:]).rstrip("\n") for f in sorted(others, key=lambda f: f[1])
        ]
    else:
        lines.append("  <NO_OTHER_FAILURES>")
    lines += [
        "-" * 56,
        "Root Cause (first observed failure):",
        _entry_text(first[0], spec, *first[1:]).rstrip("\n"),
    ]
    lines.append(bar)
    return "\n".join(lines)

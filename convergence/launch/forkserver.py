"""Warm starts: a fork server per session, so a job costs its steps rather than its imports.

A job run through torchrun pays, every time, the agent's ``import torch`` and each rank's imports
of torch, torch.distributed, FSDP, DTensor, pipelining and ``torch._dynamo`` (~2-3 s of a 4.4 s
2-rank debug job on 2 cores; BENCHMARKS.md "Job fixed cost"). Here a *server* process imports
that stack once per session and then forks, per job, a fresh *agent* that forks the job's
*ranks*. Nothing is shared between jobs but what the imports built: every job's ranks are new
processes, so a hook's monkeypatch, a leaked global or a CUDA context never crosses jobs. The
server never initialises CUDA (it checks before every fork); each rank does, after it was given
its own ``CUDA_VISIBLE_DEVICES``.

Processes::

    launcher (pytest) ──stdin pipe, unix socket──> server   (imports once; one per import env)
                                                     └─ agent     (one per job; own session)
                                                          ├─ rank 0  (``python -m ...`` of the
                                                          └─ rank 1   request, via runpy)

The agent is torchrun's stand-in for one node (launch/warm_agent.py): it hosts the job's c10d
store on 127.0.0.1 (the ranks join it as torchrun's do: ``TORCHELASTIC_USE_AGENT_STORE``), gives
each rank the environment a torch entry point expects of torchrun, writes each rank's output to
``<log_dir>/ranks/<id>_warm/attempt_0/<local_rank>/{stdout,stderr}.log``, ends the others when
one rank fails, and writes how each rank ended as JSON (launch/rank_exits.py; launch/failure.py
reads it). A forked rank's ``/proc/<pid>/environ`` is its server's, so the agent also lists its
ranks in ``<log_dir>/ranks/warm_ranks.json`` (launch/hang.py names a hung rank from it).

Lifetimes: a session owns its servers (launch/fork_servers.py: the run session closes them at
its end). The launcher's process holds each server's stdin; when that process ends in any way,
the pipe closes and the server ends its agents (SIGTERM, then SIGKILL) and exits. An agent dies
with its server (parent-death SIGTERM) and its ranks with their agent (parent-death SIGKILL), so
killing pytest outright leaves nothing. The launcher ends a job's tree by PID exactly as it ends
a torchrun tree (launch/process_tree.py): the agent forwards SIGTERM to its ranks.

The import environment: a server is shared by the jobs whose working folder and import-time
environment (:data:`IMPORT_ENV_PREFIXES`: PYTHONPATH, torch's and OpenMP's variables, ...)
are the same; a job that differs gets its own server, so it imports exactly what a fresh
process would (``convergence ab`` runs another checkout through PYTHONPATH). A backend whose
ranks import more than this stack (torchtitan) names those modules (``warm_imports``): its jobs
get a server that imports them too, after the stack, and no other job shares that server.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from convergence.launch.warm_agent import WarmJobSpec, run_agent
from convergence.phase_marks import process_cpu_s

WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch._dynamo",  # imported anyway by deterministic mode and the meta-device model build
    "torch.distributed.elastic.multiprocessing.errors",  # @record, in many entry points
    "convergence.trainer.train",
)
"""What the server imports once. Anything else a job imports, its ranks import themselves."""

IMPORT_ENV_PREFIXES = (
    "PYTHON",
    "LD_",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TRITON",
    "CONVERGENCE_WARM",
)
"""Variables read while the stack is imported (or when OpenMP loads): a server is started with
the job's values of these, and only jobs with the same values share it."""

RANKS_FILE = "warm_ranks.json"
"""``{pid: {"rank": r, "local_rank": l}}`` of a warm job's ranks, in ``<log_dir>/ranks``."""

START_TIMEOUT_S = 300.0
"""The server's imports on a loaded machine: seconds, rarely a minute."""

TERM_GRACE_S = 5.0
"""An agent asked to end (SIGTERM) gives its ranks this long before SIGKILL."""


class ForkServerError(RuntimeError):
    """The server did not start or answer; the message says why (its stderr tail)."""


def warm_entry_problem(entry: Sequence[str]) -> str | None:
    """Why ``entry`` cannot start warm (then the job goes through torchrun), or None.

    A warm rank runs ``-m module args`` or ``script.py args`` as ``python`` would; interpreter
    options (``-X``, ``-u``, ``-c``...) need a fresh interpreter."""
    if not entry:
        return "no command"
    first = entry[0]
    if first == "-m":
        return None if len(entry) >= 2 else "'-m' without a module"
    if first.startswith("-"):
        return f"interpreter option {first!r}"
    return None


def import_env_key(env: Mapping[str, str], cwd: str) -> tuple[tuple[str, str], ...]:
    """What decides which server may run a job: its folder and its import-time variables."""
    pairs = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES))
    return (("cwd", cwd), *pairs)


# ---------------------------------------------------------------------------- launcher side


class WarmJob:
    """A running warm job as the launcher sees it: the agent's PID and its exit status, which
    the server reports when it reaps the agent. ``poll``/``returncode`` as ``Popen``'s."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._buf = b""
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait_reported(self, timeout_s: float) -> int | None:
        """The agent's exit status once the server reaped it (after the launcher ended the
        tree), or None if the server did not say within ``timeout_s``."""
        if self.returncode is None:
            self._read(timeout_s)
        return self.returncode

    def _read(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return
            chunk = self._conn.recv(4096)
            if not chunk:  # the server is gone: the agent died with it
                self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode
                self.close()
                return
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        self.returncode = int(json.loads(line)["returncode"])
        self.close()

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


class ForkServer:
    """One server process (see the module docstring), started at construction."""

    def __init__(
        self, *, python: str, env: Mapping[str, str], cwd: str, imports: Sequence[str] = ()
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="convergence-warm-")
        self.socket_path = os.path.join(self._dir, "server.sock")
        self._stderr_path = os.path.join(self._dir, "server.log")
        started = time.monotonic()
        with open(self._stderr_path, "wb") as err:
            # Its own session: a Ctrl-C in a terminal reaches pytest, which ends jobs in order.
            self.proc = subprocess.Popen(
                [python, "-m", "convergence.launch.forkserver", self.socket_path, *imports],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line.startswith(b"ready"):
            self.close()
            raise ForkServerError(
                f"the warm-start server did not start ({self._stderr_tail()}); run with "
                "--convergence-launcher torchrun to start jobs without it"
            )
        fields = line.split()
        self.start_wall_s = time.monotonic() - started
        self.start_cpu_s = float(fields[1]) if len(fields) > 1 else float("nan")
        self._lock = threading.Lock()

    def _stderr_tail(self) -> str:
        try:
            text = Path(self._stderr_path).read_text(errors="replace").strip()
        except OSError:
            return "no output"
        return text[-2000:] or f"exit code {self.proc.poll()}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def start_job(self, spec: WarmJobSpec) -> WarmJob:
        """Fork the job's agent; returns once its PID is known."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
            conn.sendall(spec.to_json().encode() + b"\n")
            buf = b""
            while b"\n" not in buf:
                ready, _, _ = select.select([conn], [], [], 60.0)
                chunk = conn.recv(4096) if ready else b""
                if not chunk:
                    raise ForkServerError(
                        f"the warm-start server did not answer ({self._stderr_tail()})"
                    )
                buf += chunk
        except OSError as exc:
            conn.close()
            raise ForkServerError(f"the warm-start server is unreachable: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        line, _, rest = buf.partition(b"\n")
        answer = json.loads(line)
        if "error" in answer:
            conn.close()
            raise ForkServerError(f"the warm-start server refused the job: {answer['error']}")
        job = WarmJob(conn, int(answer["pid"]))
        job._buf = rest
        return job

    def close(self) -> None:
        """End the server (its agents too: it ends them when its stdin closes)."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=TERM_GRACE_S + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for path in (self.socket_path, self._stderr_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


# ------------------------------------------------------------------------------ server side


def _import_stack(extra: Sequence[str] = ()) -> None:
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)
    for name in extra:
        # A backend's modules (LaunchRequest.warm_imports): one that does not import here is
        # left to the ranks, which then fail with their own error, in their own log.
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- any import error: the ranks will say it
            print(f"warm import {name} failed: {exc!r}", file=sys.stderr, flush=True)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def serve(socket_path: str, extra_imports: Sequence[str] = ()) -> NoReturn:
    """The server's loop: fork an agent per request, report each agent's exit status."""
    _import_stack(extra_imports)
    import gc

    # Objects the imports made are never collected: the children's collections then do not
    # touch (and copy) the parent's pages.
    gc.collect()
    gc.freeze()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; see the docstring
    sys.stdout.write(f"ready {process_cpu_s():.3f}\n")
    sys.stdout.flush()
    agents: dict[int, socket.socket | None] = {}
    stdin = sys.stdin.fileno()
    while not stop:
        watched = [listener.fileno(), stdin, *(c.fileno() for c in agents.values() if c)]
        try:
            ready, _, _ = select.select(watched, [], [], 0.05)
        except InterruptedError:
            ready = []
        if stdin in ready and not os.read(stdin, 4096):
            break  # the launcher's process ended (or closed us): end every job
        if os.getppid() != parent:
            break
        if listener.fileno() in ready:
            new_conn, _ = listener.accept()
            pid = _fork_agent(new_conn, listener, agents)
            if pid is not None:
                agents[pid] = new_conn
        for pid, conn in list(agents.items()):
            if conn is not None and conn.fileno() in ready:
                try:
                    gone = not conn.recv(4096)
                except OSError:
                    gone = True
                if gone:  # the launcher ended the job itself; nobody waits for its status
                    conn.close()
                    agents[pid] = None
        _reap(agents)
    _end_agents(agents)
    os._exit(0)


def _fork_agent(
    conn: socket.socket, listener: socket.socket, agents: dict[int, socket.socket | None]
) -> int | None:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            conn.close()
            return None
        buf += chunk
    spec = WarmJobSpec(**json.loads(buf.partition(b"\n")[0]))
    if _cuda_initialised():
        # Every child would share the parent's CUDA context: refuse rather than corrupt.
        conn.sendall(b'{"error": "CUDA was initialised in the warm-start server"}\n')
        conn.close()
        return None
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for other in agents.values():
                if other is not None:
                    other.close()
            conn.close()
            code = run_agent(spec, server_pid=server)
        except BaseException:  # noqa: BLE001 -- an agent never returns into the server loop
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _reap(agents: dict[int, socket.socket | None]) -> None:
    while agents:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = agents.pop(pid, None)
        if conn is not None:
            try:
                code = os.waitstatus_to_exitcode(status)
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            except OSError:
                pass
            conn.close()


def _end_agents(agents: dict[int, socket.socket | None]) -> None:
    for pid in agents:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + TERM_GRACE_S + 1.0
    while agents and time.monotonic() < deadline:
        _reap(agents)
        time.sleep(0.02)
    for pid in agents:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main() -> None:
    if len(sys.argv) < 2:
        print(
            "usage: python -m convergence.launch.forkserver SOCKET_PATH [MODULE ...]",
            file=sys.stderr,
        )
        raise SystemExit(2)
    serve(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()

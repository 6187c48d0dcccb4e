"""``torchrun`` whose stores listen on loopback only: the entry point of standalone jobs.

Run as ``python -m convergence.launch.loopback_torchrun ARGS`` with torchrun's own arguments.

Why: a one-node job rendezvous on ``localhost``, but torch 2.13's TCPStore server binds every
interface (``::``) whatever host name it is given, and torchrun has no option to change that.
The agent hosts two stores (the c10d rendezvous store and the workers' bootstrap store, whose
address the ranks get as ``MASTER_ADDR=localhost``), so on a shared host anyone who can reach
the machine could talk to them while a job trains.

How: TCPStore accepts ``master_listen_fd``, a socket the caller has already bound. When this
process is to *host* a store for a loopback host name, we bind ``127.0.0.1`` ourselves and hand
the socket over. Clients connect to ``localhost`` as before (the TCPStore client tries every
address the name resolves to). Stores for any other host (multi-node rendezvous under Slurm)
are created exactly as torchrun would. The two places patched are torch internals
(``c10d_rendezvous_backend.TCPStore`` and ``DynamicRendezvousHandler._create_tcp_store_server``);
if a later torch moves them, this entry point says so on stderr and runs torchrun unchanged.

Every torchrun this project starts (one node or a Slurm step) goes through here, which also
takes the fixed cost off each job: no random sleep before the rendezvous
(:func:`skip_rendezvous_skew`) and no interpreter finalization once the ranks are done.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from convergence.dist_exit import run_and_exit
from convergence.launch.types import LOOPBACK_NAMES
from convergence.phase_marks import mark, process_cpu_s

_listening: list[socket.socket] = []
"""Bound sockets handed to TCPStore: kept referenced so Python never closes their fds."""


def _bind_loopback(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    _listening.append(sock)
    return sock


def loopback_store(
    store_class: Any, host: str, port: int, *args: Any, is_master: bool = False, **kwargs: Any
) -> Any:
    """``store_class(host, port, ...)``, listening on 127.0.0.1 when it hosts a loopback store."""
    if is_master and host in LOOPBACK_NAMES and kwargs.get("master_listen_fd") is None:
        sock = _bind_loopback(port)
        port = sock.getsockname()[1]  # port 0 means "any": the bound one is the real one
        kwargs["master_listen_fd"] = sock.fileno()
    return store_class(host, port, *args, is_master=is_master, **kwargs)


def install() -> bool:
    """Patch torchrun's two store constructors; False (and nothing patched) if they moved."""
    try:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    except ImportError:
        return False
    if not (
        hasattr(backend, "TCPStore")
        and hasattr(DynamicRendezvousHandler, "_create_tcp_store_server")
    ):
        return False
    store_class = backend.TCPStore

    def rendezvous_store(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        return loopback_store(store_class, host, port, *args, **kwargs)

    def bootstrap_store(self: Any, master_addr: str, master_port: int) -> Any:
        return loopback_store(
            dist.TCPStore,  # type: ignore[attr-defined]
            host=master_addr,
            port=master_port,
            is_master=True,
            multi_tenant=True,
        )

    backend.TCPStore = rendezvous_store
    # On the class (not an instance): every handler torchrun creates uses it.
    handler = DynamicRendezvousHandler
    handler._create_tcp_store_server = bootstrap_store  # type: ignore[method-assign]
    return True


def skip_rendezvous_skew() -> bool:
    """Drop the random 0-0.3 s sleep before a node's first rendezvous round.

    torch sleeps so that many nodes do not all hit the rendezvous backend at once; a job of one
    node (or of a few Slurm nodes) pays up to 0.3 s per job for nothing. Only the random form
    (a ``(low, high)`` tuple) is skipped; fixed retry waits stay. False if torch moved it."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return False
    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None:
        return False

    def no_random_delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            delay(seconds)

    setattr(dynamic_rendezvous, "_delay", no_random_delay)  # noqa: B010 -- private name
    return True


def main() -> int:
    if not install():
        print(
            "convergence: torch moved torchrun's store constructors; the rendezvous stores "
            "of this job listen on every interface",
            file=sys.stderr,
        )
    skip_rendezvous_skew()
    from torch.distributed.run import main as torchrun_main

    mark("agent_imported")
    try:
        torchrun_main()
    finally:
        mark("agent_exit", cpu_s=process_cpu_s(children=True))
    return 0


if __name__ == "__main__":
    # The agent's work ends when its ranks have: leave without interpreter finalization (up to
    # 0.5 s of a 2-rank job's wall time: torch's modules and threads torn down for nothing).
    # A failure's report still reaches stderr (run_and_exit prints the traceback, exit 1).
    run_and_exit(main)

"""A real one-node Slurm for tests: Debian's munge + slurmctld + slurmd, no systemd.

:func:`start_cluster` writes a private ``slurm.conf`` (this host, 2 CPUs, one partition), a
private munge key and socket (a system munged, if any, is left alone), starts ``munged``,
``slurmctld -D`` and ``slurmd -D`` in the background as root, and waits until the node is idle.
:meth:`SlurmCluster.stop` ends exactly those PIDs. Everything lives in one temporary folder;
clients find it through ``SLURM_CONF`` (see :meth:`SlurmCluster.env`).

Installing (CI does this once, in ``.ci/run``)::

    apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd munge slurm-client

When the binaries are missing, :func:`ensure_installed` tries that apt-get line itself (root
only) unless ``CONVERGENCE_SLURM_NO_INSTALL=1``; every reason Slurm cannot run here is raised as
:class:`SlurmUnavailable` so the tests can skip with it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

BINARIES = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "salloc",
    "scontrol",
    "squeue",
    "scancel",
)
APT_PACKAGES = ("slurmctld", "slurmd", "munge", "slurm-client")
INSTALL_TIMEOUT_S = 600.0
START_TIMEOUT_S = 60.0


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here (the message says why)."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _which(name: str) -> str:
    found = shutil.which(name) or str(Path("/usr/sbin", name))
    return found


def ensure_installed() -> None:
    """Install the Debian packages if a binary is missing (root + apt-get), else raise."""
    if not missing_binaries():
        return
    if os.environ.get("CONVERGENCE_SLURM_NO_INSTALL") == "1":
        raise SlurmUnavailable(
            f"Slurm binaries missing ({', '.join(missing_binaries())}) and "
            "CONVERGENCE_SLURM_NO_INSTALL=1"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            "Slurm is not installed and installing it needs root "
            f"(apt-get install {' '.join(APT_PACKAGES)})"
        )
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *APT_PACKAGES],
    ):
        try:
            done = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmUnavailable(f"{' '.join(argv)} failed: {exc}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise SlurmUnavailable(f"{' '.join(argv)} failed: {' | '.join(tail)}")
    if missing_binaries():
        raise SlurmUnavailable(f"still missing after apt-get: {', '.join(missing_binaries())}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _slurm_conf(
    root: Path,
    node: str,
    ctld_port: int,
    slurmd_port: int,
    munge_socket: Path,
    *,
    ctld_addr: str = "127.0.0.1",
    nodes: tuple[tuple[str, str], ...] | None = None,
    cpus: int = 2,
) -> str:
    # Why these settings: no cgroups or systemd in containers (proctrack/linuxproc,
    # task/none); root runs everything; short KillWait/MinJobAge so cancelled steps and ended
    # jobs disappear quickly; config_overrides so a sandbox that reports odd CPU topology
    # still registers the node with the CPUs written here. ``nodes``: (name, address) of each
    # slurmd (the multi-node cluster); default: this host as the one node, on loopback.
    members = nodes or ((node, "127.0.0.1"),)
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr={addr} NodeHostname={name} CPUs={cpus} "
        "RealMemory=1000 State=UNKNOWN"
        for name, addr in members
    )
    names = ",".join(name for name, _ in members)
    pid_file = "slurmd-%n.pid" if nodes else "slurmd.pid"
    log_file = "slurmd-%n.log" if nodes else "slurmd.log"
    return f"""\
ClusterName=convergence-test
SlurmctldHost={node}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/{pid_file}
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/{log_file}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=2
MinJobAge=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{node_lines}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass(kw_only=True)
class SlurmCluster:
    """A running one-node cluster (see module docstring)."""

    root: Path
    node: str
    conf: Path
    pids: dict[str, int] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (srun, sbatch, ...) to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, *argv: str, timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}): "
                f"{done.stderr.strip()} {done.stdout.strip()}"
            )
        return done

    def log_tail(self, lines: int = 15) -> str:
        out = []
        names = [
            "munged.log",
            "slurmctld.log",
            *sorted(p.name for p in self.root.glob("slurmd*.log")),
        ]
        for name in names:
            path = self.root / name
            if path.exists():
                text = path.read_text(errors="replace").strip().splitlines()[-lines:]
                out.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel this cluster's jobs, then end the daemons it started, by PID, one at a time
        (slurmd, slurmctld, munged: each still needs the next while it shuts down)."""
        if self.procs and all(p.poll() is None for p in self.procs):
            try:
                self.run("scancel", "--full", "--user", "root", check=False, timeout=20)
                deadline = time.monotonic() + 20.0
                while (
                    time.monotonic() < deadline
                    and self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.strip()
                ):
                    time.sleep(0.2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)


def _spawn(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    log = open(cluster.root / f"{name}.out", "wb")
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=cluster.env(),
        start_new_session=True,
    )
    log.close()
    cluster.procs.append(proc)
    cluster.pids[name] = proc.pid


def _wait_for(
    cluster: SlurmCluster, what: str, check: Callable[[], bool], timeout: float = START_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in zip(cluster.pids, cluster.procs, strict=False):
            if proc.poll() is not None:
                raise SlurmUnavailable(
                    f"{name} exited with {proc.returncode} while waiting "
                    f"for {what}\n{cluster.log_tail()}"
                )
        if check():
            return
        time.sleep(0.2)
    raise SlurmUnavailable(f"timed out waiting for {what}\n{cluster.log_tail()}")


def _node_idle(cluster: SlurmCluster) -> bool:
    try:
        done = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and done.stdout.strip() in ("idle", "mixed")


def _prepare_root(root: Path) -> Path:
    """The cluster's folders and a fresh munge key under ``root``; returns munged's socket."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(exist_ok=True)
    munge_dir = root / "munge"
    os.chmod(root, 0o755)
    os.chmod(munge_dir, 0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(128))
    os.chmod(key, 0o600)
    return munge_dir / "munge.socket"


def _start_munged(cluster: SlurmCluster, munge_socket: Path) -> None:
    """munged with the key _prepare_root wrote, up once its socket exists."""
    munge_dir = munge_socket.parent
    _spawn(
        cluster,
        "munged",
        [
            _which("munged"),
            "-F",
            "--force",
            f"--key-file={munge_dir / 'munge.key'}",
            f"--socket={munge_socket}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={cluster.root / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ],
    )
    _wait_for(cluster, "munged's socket", munge_socket.exists, timeout=20)


def start_cluster(root: Path) -> SlurmCluster:
    """Install if needed, then start munged, slurmctld and slurmd; raise SlurmUnavailable."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("starting slurmd/slurmctld needs root")
    ensure_installed()
    munge_socket = _prepare_root(root)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, _free_port(), _free_port(), munge_socket))
    cluster = SlurmCluster(root=root, node=node, conf=conf)
    try:
        _start_munged(cluster, munge_socket)
        _spawn(cluster, "slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(conf)])
        _spawn(cluster, "slurmd", [_which("slurmd"), "-D", "-N", node, "-f", str(conf)])
        _wait_for(cluster, "the node to become idle", lambda: _node_idle(cluster))
    except BaseException:
        cluster.stop()
        raise
    return cluster


# -- several nodes on this one machine ---------------------------------------------------------
#
# Each slurmd runs in its own network namespace (``ip netns``) with its own address on a private
# bridge and, in its own UTS namespace, its own hostname: to Slurm and to torchrun's c10d
# rendezvous they are separate machines (torchrun hosts the store only on the node whose
# hostname or address is the endpoint's). Each slurmd also has a private mount namespace where
# /etc/netns/<ns>/hosts is bind-mounted over /etc/hosts: how each node resolves the others by
# name (what ``ip netns exec`` does; see start_multinode for why it is not used). The filesystem, and so
# the munge socket, the run folders and the Python environment, stay shared: like a cluster's
# shared filesystem. Traffic never leaves the machine (a bridge with no uplink).

NODE_PREFIX = "cnode"


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SlurmUnavailable(f"`ip {' '.join(argv)}` failed: {done.stderr.strip()}")


@dataclass(kw_only=True)
class Network:
    """The bridge, veth pairs and namespaces of a multi-node cluster (see above)."""

    tag: str
    bridge: str
    gateway: str
    nodes: dict[str, str] = field(default_factory=dict)
    """Node name -> its address."""
    namespaces: dict[str, str] = field(default_factory=dict)
    """Node name -> its network namespace."""

    def remove(self) -> None:
        """Delete the namespaces (their veth ends, and so the pairs, go with them), the
        /etc/netns files and the bridge; ignores what is already gone."""
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    def pids_in(self, node: str) -> list[int]:
        """PIDs of the processes living in ``node``'s namespace."""
        done = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[node]],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return [int(p) for p in done.stdout.split() if p.isdigit()]


_OURS = re.compile(r"^cv(\d+)-" + NODE_PREFIX + r"\d+$")


def sweep_stale_networks() -> list[str]:
    """Remove the namespaces, /etc/netns files and bridges of earlier test sessions that died
    without cleaning up (their PID, part of every name, is gone); returns what was removed."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    removed = []
    for line in done.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        match = _OURS.match(ns)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)
        subprocess.run(
            ["ip", "link", "del", f"cv{match.group(1)}br"], capture_output=True, timeout=30
        )
        removed.append(ns)
    return removed


def make_network(num_nodes: int) -> Network:
    """Bridge ``cv<pid>br`` (10.213.<k>.1/24) and one namespace per node at .11, .12, ..."""
    if shutil.which("ip") is None:
        raise SlurmUnavailable("no `ip` command (apt-get install iproute2)")
    sweep_stale_networks()
    tag = f"cv{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250 + 1}"
    net = Network(tag=tag, bridge=f"{tag}br", gateway=f"{subnet}.1")
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        names = [f"{NODE_PREFIX}{i + 1}" for i in range(num_nodes)]
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{subnet}.{11 + i} {name}\n" for i, name in enumerate(names)
        )
        for i, name in enumerate(names):
            ns, outer, inner = f"{tag}-{name}", f"{tag}h{i}", f"{tag}n{i}"
            addr = f"{subnet}.{11 + i}"
            _ip("netns", "add", ns)
            net.namespaces[name] = ns
            net.nodes[name] = addr
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", net.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns", ns)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
    except BaseException:
        net.remove()
        raise
    return net


@dataclass(kw_only=True)
class MultiNodeCluster(SlurmCluster):
    """A running cluster of several slurmd nodes on this machine (see :func:`start_multinode`)."""

    network: Network
    node_names: tuple[str, ...] = ()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.network.remove()


def _nodes_idle(cluster: MultiNodeCluster) -> bool:
    try:
        done = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
    return done.returncode == 0 and all(
        states.get(n) in ("idle", "mixed") for n in cluster.node_names
    )


def start_multinode(root: Path, num_nodes: int = 2, cpus: int = 2) -> MultiNodeCluster:
    """munged + slurmctld on this host, one slurmd per node in its own network and UTS
    namespace (see above); raise SlurmUnavailable where that cannot be done."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("starting slurmd/slurmctld and network namespaces needs root")
    ensure_installed()
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            raise SlurmUnavailable(f"no `{tool}` command (util-linux)")
    network = make_network(num_nodes)
    try:
        munge_socket = _prepare_root(root)
        conf = root / "slurm.conf"
        host = socket.gethostname().split(".")[0]
        conf.write_text(
            _slurm_conf(
                root,
                host,
                _free_port(),
                _free_port(),
                munge_socket,
                ctld_addr=network.gateway,
                nodes=tuple(network.nodes.items()),
                cpus=cpus,
            )
        )
    except BaseException:
        network.remove()
        raise
    cluster = MultiNodeCluster(
        root=root, node=host, conf=conf, network=network, node_names=tuple(network.nodes)
    )
    try:
        _start_munged(cluster, munge_socket)
        _spawn(cluster, "slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(conf)])
        for name, ns in network.namespaces.items():
            (root / "spool" / name).mkdir(exist_ok=True)
            hosts = Path("/etc/netns", ns, "hosts")
            # nsenter --net (not `ip netns exec`, which remounts /sys without the cgroup
            # filesystem slurmd needs), then private UTS and mount namespaces for the hostname
            # and /etc/hosts. nsenter and unshare exec, sh execs slurmd: the PID is slurmd's.
            _spawn(
                cluster,
                f"slurmd-{name}",
                [
                    "nsenter",
                    f"--net=/run/netns/{ns}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    f"mount --bind {hosts} /etc/hosts && hostname {name} && "
                    f'exec "$0" -D -N {name} -f "$1"',
                    _which("slurmd"),
                    str(conf),
                ],
            )
        _wait_for(cluster, "the nodes to become idle", lambda: _nodes_idle(cluster))
    except BaseException:
        cluster.stop()
        raise
    return cluster


# -- one running test cluster, for a test module ------------------------------------------

LOCK = Path("/tmp/convergence-slurm-tests.lock")
"""One test cluster per host at a time: xdist workers and a second suite beside this one take
turns (two clusters at once on 2 cores made the one-node sbatch --wait time out)."""

ClusterT = TypeVar("ClusterT", bound=SlurmCluster)


@contextmanager
def running(start: Callable[[], ClusterT], *, what: str) -> Iterator[ClusterT]:
    """Start a cluster under the host-wide lock, point SLURM_CONF at it (srun, squeue and
    scontrol of the launcher find it), and on exit stop it, restore SLURM_CONF and check that
    no daemon is left. Where Slurm cannot run: skipped with the reason, or failed under CI=true
    (.ci/run installs Slurm, so there a missing cluster is a broken CI, not a skip)."""
    import psutil
    import pytest
    from filelock import FileLock

    with FileLock(str(LOCK)):
        try:
            cluster = start()
        except SlurmUnavailable as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(f"CI=true but no {what} here: {exc}")
            pytest.skip(f"no {what} here: {exc}")
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            yield cluster
        finally:
            cluster.stop()
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old
            left = [
                pid
                for pid in cluster.pids.values()
                if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            ]
            assert not left, f"Slurm daemons still running: {left}"

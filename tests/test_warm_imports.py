"""A backend's warm imports (``LaunchRequest.warm_imports``, ``Capabilities.warm_imports``):
modules a job's ranks import beyond the fork server's stack, imported once by a server of their
own (launch/forkserver.py, launch/fork_servers.py; torchtitan's: backends/torchtitan/warm.py).

- A job whose request names a module finds it already imported in its forked ranks; a job
  without warm imports, in the same session, gets another server and does not.
- A warm import that fails does not stop the server: the job runs (and would import the
  module itself), the server's log says which import failed.
- torchtitan's jobs ask for torchtitan's warm module, whose import on a CPU build of torch has
  made the CPU device choice and imported torchtitan's trainer (what the ranks then skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convergence.launch.fork_servers import ForkServers
from convergence.launch.start_warm import WarmStart
from convergence.launch.torchrun import LocalLauncher
from convergence.launch.types import LaunchRequest

#: Rank 0 writes whether the marker module was imported before it started (it never imports it).
PROBE = """
import os, sys
if os.environ.get("RANK", "0") == "0":
    with open(sys.argv[1], "w") as out:
        out.write("yes" if "warm_marker" in sys.modules else "no")
"""


def _request(tmp_path: Path, name: str, imports: tuple[str, ...]) -> tuple[LaunchRequest, Path]:
    script = tmp_path / "probe_modules.py"
    script.write_text(PROBE)
    (tmp_path / "warm_marker.py").write_text("VALUE = 1\n")
    (tmp_path / "warm_broken.py").write_text("raise ImportError('planted')\n")
    answer = tmp_path / f"{name}.txt"
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    request = LaunchRequest(
        name=name,
        entry=[str(script), str(answer)],
        nproc=2,
        log_dir=tmp_path / name / "logs",
        env={"PYTHONPATH": path},
        warm_imports=imports,
        wall_limit_s=120,
    )
    return request, answer


def _launcher(servers: ForkServers) -> LocalLauncher:
    launcher = LocalLauncher(start="warm")
    launcher.warm = WarmStart(python=sys.executable, servers=servers)
    return launcher


def test_a_jobs_warm_imports_are_in_its_ranks_and_only_in_its_servers(tmp_path: Path) -> None:
    with ForkServers() as servers:
        launcher = _launcher(servers)
        with_marker, said_with = _request(tmp_path, "with", ("warm_marker",))
        plain, said_plain = _request(tmp_path, "plain", ())
        for request in (with_marker, plain):
            result = launcher.launch(request)
            assert result.status == "ok", (result, request.log_dir)
            assert "# warm agent: " in (request.log_dir / "launcher.log").read_text()
        assert said_with.read_text() == "yes"  # imported by its server, not by the rank
        assert said_plain.read_text() == "no"  # another server: nothing it did not import
        assert len(servers.pids()) == 2, servers.pids()


def test_a_failing_warm_import_leaves_the_server_running_and_says_so(tmp_path: Path) -> None:
    with ForkServers() as servers:
        request, said = _request(tmp_path, "broken", ("warm_broken", "warm_marker"))
        result = _launcher(servers).launch(request)
        assert result.status == "ok", (result, request.log_dir)
        assert said.read_text() == "yes"  # the imports after the failing one still ran
        (server,) = servers._servers.values()
        log = Path(server._stderr_path).read_text()
        assert "warm import warm_broken failed" in log and "planted" in log, log


def test_torchtitans_warm_module_makes_the_cpu_choice_and_imports_its_trainer() -> None:
    if not os.environ.get("CI"):
        pytest.importorskip("torchtitan", reason="torchtitan is an optional extra")
    from convergence.backends.torchtitan.backend import TorchtitanBackend

    (module,) = TorchtitanBackend.capabilities.warm_imports
    # A fresh interpreter, as a fork server is: what the import leaves behind.
    code = (
        f"import sys, {module} as warm, torchtitan.tools.utils as u; "
        "print(warm.cpu_only_build(), u.device_type, "
        "'convergence.backends.torchtitan.trainer_class' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    import torch

    if torch.version.cuda is None:
        assert out == ["True", "cpu", "True"], out
    else:  # a CUDA build: the ranks choose their device; nothing is imported for them
        assert out[0] == "False" and out[2] == "False", out

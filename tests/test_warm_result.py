"""The warm agent's structured result, read first by the failure reader, and the fork servers'
lifetime owned by the run session (launch/rank_exits.py, launch/fork_servers.py).

- A warm job whose rank 1 raises leaves ``agent_result.json``: every rank with its pid and
  exit code, rank 1 the first failure; the job's failure names rank 1, and its launcher.log
  holds no torchrun report that could have been parsed instead.
- The failure reader takes the JSON before torchrun's text: a folder whose JSON and text
  disagree is read from the JSON (rank and exit code).
- A closed session's fork server process is gone (by PID).
- A warm start that cannot start falls back to torchrun, and the job's log says why.
- The plugin closes its session at pytest_unconfigure: the server is gone before pytest exits.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from test_launch_argv_failure import SIGKILL_REPORT
from test_launch_local import assert_no_survivors, make_request

from convergence.launch.failure import diagnose
from convergence.launch.fork_servers import ForkServers
from convergence.launch.rank_exits import RESULT_FILE, RankExit, RankExits, read_result, to_json
from convergence.launch.start_warm import WarmStart
from convergence.launch.torchrun import LocalLauncher
from convergence.run.jobs import RunSettings
from convergence.run.session import SessionRunner


def test_a_warm_rank_that_raises_is_named_from_the_agents_result(tmp_path: Path) -> None:
    req = make_request(tmp_path, "raise_on_rank1", name="warm-boom", steps=4)
    result = LocalLauncher(start="warm").launch(req)
    assert result.status == "failed", result
    log = (req.log_dir / "launcher.log").read_text()
    assert "# warm agent: " in log and "Root Cause" not in log, log  # started warm, no report
    data = json.loads((req.log_dir / RESULT_FILE).read_text())
    assert data["first_failure"] == 1, data
    by_rank = {r["rank"]: r for r in data["ranks"]}
    assert sorted(by_rank) == [0, 1], data
    assert by_rank[1]["exitcode"] == 1 and not by_rank[1]["ended_by_agent"], data
    assert all(isinstance(r["pid"], int) for r in data["ranks"]), data
    exits = read_result(req.log_dir)
    assert exits is not None and exits.first_failure is not None
    assert (exits.first_failure.rank, exits.first_failure.exitcode) == (1, 1)
    assert result.failure is not None and result.failure.rank == 1, result.failure
    assert "RuntimeError: boom on rank 1 at step 2" in result.failure.traceback
    assert_no_survivors(req, at_least=3)


def test_the_structured_result_is_read_before_torchruns_text(tmp_path: Path) -> None:
    # torchrun's text names rank 1 killed by SIGKILL; the agent's result says rank 0 exited 7
    # (no traceback anywhere): the reader must say what the JSON says.
    (tmp_path / "launcher.log").write_text(SIGKILL_REPORT)
    ranks = (
        RankExit(rank=0, local_rank=0, exitcode=7, error_file=None, signal=None, pid=11),
        RankExit(
            rank=1,
            local_rank=1,
            exitcode=-15,
            error_file=None,
            signal="SIGTERM",
            pid=12,
            ended_by_agent=True,
        ),
    )
    (tmp_path / RESULT_FILE).write_text(to_json(RankExits(ranks=ranks, first_failure=ranks[0])))
    failure = diagnose(tmp_path, name="j", returncode=1)
    assert failure.rank == 0 and failure.signal is None, failure
    assert "rank 0 failed: exit code 7" in failure.message, failure.message
    # Without the JSON the same folder is read through the torchrun adapter.
    (tmp_path / RESULT_FILE).unlink()
    failure = diagnose(tmp_path, name="j", returncode=1)
    assert failure.rank == 1 and failure.signal == "SIGKILL", failure


def test_a_closed_session_leaves_no_fork_server(tmp_path: Path) -> None:
    session = SessionRunner(RunSettings(work_dir=tmp_path / "work"))
    launcher = session.runner().jobs.launcher
    assert isinstance(launcher, LocalLauncher)
    assert launcher.fork_servers is session.fork_servers  # the session's, not a shared set
    launcher.warm_up()
    (pid,) = session.fork_servers.pids()
    assert psutil.Process(pid).is_running()
    session.close()
    assert not psutil.pid_exists(pid), f"fork server {pid} outlived its session"
    assert session.fork_servers.pids() == set()


def test_a_warm_start_that_fails_falls_back_to_torchrun_and_says_why(tmp_path: Path) -> None:
    # A "python" that exits at once: the fork server never says it is ready.
    launcher = LocalLauncher(start="warm")
    launcher.warm = WarmStart(python="/bin/true", servers=ForkServers())
    req = make_request(tmp_path, "ok", name="fallback", steps=2)
    result = launcher.launch(req)
    assert result.status == "ok", result
    log = (req.log_dir / "launcher.log").read_text()
    assert "the warm-start server did not start" in log and "starting with torchrun" in log, log
    assert "loopback_torchrun" in log.split("starting with torchrun", 1)[1], log
    assert not (req.log_dir / RESULT_FILE).exists()  # torchrun writes no structured result


INNER_TEST = """
from pathlib import Path

from pytest_convergence.stash import get_state


def test_the_session_starts_its_fork_server(pytestconfig):
    session = get_state(pytestconfig).runner
    session.runner().jobs.launcher.warm_up()
    (pid,) = session.fork_servers.pids()
    Path("server.pid").write_text(str(pid))
"""

INNER_CONFTEST = """
from pathlib import Path

import psutil
import pytest
import pytest


@pytest.hookimpl(trylast=True)  # after the plugin's: is the server gone before pytest exits?
def pytest_unconfigure(config):
    pid = int(Path("server.pid").read_text())
    Path("at_exit.txt").write_text("alive" if psutil.pid_exists(pid) else "gone")
"""


def test_the_plugin_ends_its_sessions_fork_server_at_unconfigure(
    pytester: pytest.Pytester,
) -> None:
    # Checked from inside the pytest process, before it exits: once it has, the server would
    # end anyway (its stdin pipe closes), which would prove nothing.
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    assert result.ret == 0, result.stdout.str()
    assert (pytester.path / "at_exit.txt").read_text() == "gone"

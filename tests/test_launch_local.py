"""LocalLauncher end to end: real torchrun, real processes (tests/fixtures/fake_trainers)."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from convergence.launch.process_tree import pid_alive
from convergence.launch.torchrun import PIDS_FILE, LocalLauncher, local_job_env, loopback_interface
from convergence.launch.types import JobResult, LaunchRequest, Progress

WRITER = Path(__file__).parent / "fixtures" / "fake_trainers" / "writer.py"


def make_request(
    tmp_path: Path,
    mode: str,
    *,
    name: str = "job",
    nproc: int = 2,
    steps: int = 5,
    extra: tuple[str, ...] = (),
    **kw: object,
) -> LaunchRequest:
    job_dir = tmp_path / name
    entry = [
        str(WRITER),
        "--mode",
        mode,
        "--steps",
        str(steps),
        "--metrics",
        str(job_dir / "metrics.jsonl"),
        "--stop-file",
        str(job_dir / "STOP"),
        "--pid-file",
        str(job_dir / "trainer_pids.txt"),
        *extra,
    ]
    kw.setdefault("stop_file", job_dir / "STOP")
    return LaunchRequest(
        name=name,
        entry=entry,
        nproc=nproc,
        log_dir=job_dir / "logs",
        metrics_path=job_dir / "metrics.jsonl",
        total_steps=steps,
        **kw,
    )  # type: ignore[arg-type]


def all_pids(request: LaunchRequest) -> set[int]:
    """Every PID of the job: agent + tracked descendants + what the ranks wrote themselves."""
    data = json.loads((request.log_dir / PIDS_FILE).read_text())
    pids = {int(data["agent"]), *map(int, data["descendants"])}
    own = request.log_dir.parent / "trainer_pids.txt"
    if own.exists():
        pids |= {int(x) for x in own.read_text().split()}
    # Ranks that torchrun itself ended before they wrote their pid or were seen by a scan (a
    # loaded machine): the agent's log names them ("Sending process N closing signal").
    log = request.log_dir / "launcher.log"
    if log.exists():
        pids |= {int(p) for p in re.findall(r"(?:Sending process|pid:) (\d+)", log.read_text())}
    return pids


def assert_no_survivors(request: LaunchRequest, at_least: int) -> None:
    pids = all_pids(request)
    assert len(pids) >= at_least, pids
    alive = [p for p in pids if pid_alive(p)]
    assert alive == [], f"processes outlived job {request.name}: {alive}"


def test_ok_run_reports_last_step_progress_and_leaves_nothing(tmp_path: Path) -> None:
    req = make_request(tmp_path, "ok", steps=5)
    seen: list[dict[str, float]] = []
    progress: list[Progress] = []
    launcher = LocalLauncher(progress_interval_s=0.0)
    result = launcher.launch(
        req, on_metrics=lambda r: seen.append(r) is not None, on_progress=progress.append
    )
    assert result.status == "ok", result
    assert result.ok and result.returncode == 0 and result.failure is None
    assert result.last_step == 5
    assert [r["step"] for r in seen] == [1, 2, 3, 4, 5]
    assert progress and progress[-1].step == 5 and progress[-1].total_steps == 5
    assert progress[-1].loss == pytest.approx(2.0)
    assert (req.log_dir / "launcher.log").exists()
    assert list((req.log_dir / "ranks").glob("*/attempt_0/1/stderr.log"))
    assert_no_survivors(req, at_least=3)  # agent + 2 ranks


def test_raising_rank_is_named_with_its_traceback(tmp_path: Path) -> None:
    req = make_request(tmp_path, "raise_on_rank1", name="boom-job")
    result = LocalLauncher().launch(req)
    assert result.status == "failed"
    assert result.failure is not None
    assert result.failure.rank == 1
    assert result.failure.signal is None
    assert "RuntimeError: boom on rank 1 at step 2" in result.failure.traceback
    assert "Traceback (most recent call last)" in result.failure.traceback
    assert "rank 1" in result.failure.message and "boom-job" in result.failure.message
    assert_no_survivors(req, at_least=3)


def test_recorded_rank_traceback_comes_from_torchelastic_error_file(tmp_path: Path) -> None:
    req = make_request(tmp_path, "raise_on_rank1", extra=("--record",))
    result = LocalLauncher().launch(req)
    assert result.status == "failed" and result.failure is not None
    assert result.failure.rank == 1
    assert list(req.log_dir.glob("ranks/*/attempt_0/1/error.json"))
    # py_callstack of the error file goes through @record's wrapper
    assert "errors/__init__.py" in result.failure.traceback
    assert "boom on rank 1" in result.failure.traceback


def test_sigkilled_rank_is_reported_as_killed(tmp_path: Path) -> None:
    req = make_request(tmp_path, "sigkill_rank1")
    result = LocalLauncher().launch(req)
    assert result.status == "killed", result
    assert result.failure is not None
    assert result.failure.rank == 1 and result.failure.signal == "SIGKILL"
    assert "rank 1 was killed by SIGKILL (out of memory?)" in result.failure.message
    assert_no_survivors(req, at_least=3)


def test_hanging_rank_is_hung_within_idle_limit_and_every_pid_ends(tmp_path: Path) -> None:
    req = make_request(tmp_path, "hang_rank1", name="hanger", idle_limit_s=8.0)
    result = LocalLauncher(kill_grace_s=2.0).launch(req)
    # "hung" (not "timeout"): the idle watchdog ended it, not the one-hour wall limit.
    assert result.status == "hung", result
    assert result.failure is not None and "hanger" in result.failure.message
    # Under heavy load torchrun may not reach step 1 within the idle limit: then only the
    # agent (and whatever ranks it started) can be checked.
    assert result.last_step in (None, 1)
    assert_no_survivors(req, at_least=3 if result.last_step == 1 else 1)


def test_job_silent_from_the_start_is_hung(tmp_path: Path) -> None:
    req = make_request(tmp_path, "silent", name="mute", idle_limit_s=4.0)
    result = LocalLauncher(kill_grace_s=1.0).launch(req)
    assert result.status == "hung"
    assert result.last_step is None
    assert result.failure is not None and "no step logged" in result.failure.message
    assert_no_survivors(req, at_least=1)  # ranks too, when torchrun started them in time


def test_nan_loss_stops_the_job_with_its_step(tmp_path: Path) -> None:
    req = make_request(tmp_path, "nan_at_step", steps=200, extra=("--nan-step", "3"))
    result = LocalLauncher(kill_grace_s=1.0).launch(req)
    assert result.status == "nan", result
    assert result.failure is not None and result.failure.step == 3
    assert "nan" in result.failure.message
    assert result.last_step is not None and result.last_step < 200
    assert_no_survivors(req, at_least=3)


def test_early_stop_goes_through_the_stop_file(tmp_path: Path) -> None:
    req = make_request(tmp_path, "slow", steps=100, extra=("--sleep", "0.1"))
    result = LocalLauncher(stop_grace_s=20.0).launch(req, on_metrics=lambda r: r["step"] >= 3)
    assert result.status == "stopped_early", result
    assert result.ok and result.returncode == 0  # exited by itself, not killed
    assert result.last_step is not None and 3 <= result.last_step < 100
    out = "".join(p.read_text() for p in req.log_dir.glob("ranks/*/attempt_0/*/stdout.log"))
    assert "stop file seen" in out
    assert_no_survivors(req, at_least=3)


def test_worker_ignoring_sigterm_in_own_session_still_dies(tmp_path: Path) -> None:
    req = make_request(tmp_path, "ignore_sigterm", name="stubborn", steps=2, stop_file=None)
    pid_file = req.log_dir.parent / "trainer_pids.txt"

    def stop_once_both_ranks_run(record: dict[str, float]) -> bool:
        # deterministic: every rank has written its pid (and ignores SIGTERM) before we stop
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if pid_file.exists() and len(pid_file.read_text().split()) >= 2:
                return True
            time.sleep(0.05)
        return True

    result = LocalLauncher(kill_grace_s=1.0).launch(req, on_metrics=stop_once_both_ranks_run)
    assert result.status == "stopped_early", result  # no stop file: the tree is terminated
    assert result.returncode is not None and result.returncode != 0
    assert_no_survivors(req, at_least=3)


def test_wall_clock_limit_is_a_timeout_naming_the_job(tmp_path: Path) -> None:
    req = make_request(
        tmp_path, "slow", name="slowpoke", steps=1000, extra=("--sleep", "0.1"), wall_limit_s=3.0
    )
    result = LocalLauncher(kill_grace_s=1.0).launch(req)
    assert result.status == "timeout", result
    assert result.failure is not None and "slowpoke" in result.failure.message
    assert "wall-clock limit of 3 s" in result.failure.message
    assert_no_survivors(req, at_least=1)


def test_detached_grandchild_of_a_finished_job_is_ended(tmp_path: Path) -> None:
    req = make_request(tmp_path, "orphan", steps=4, extra=("--sleep", "0.3"))
    result = LocalLauncher().launch(req)
    assert result.status == "ok", result
    trainer_pids = (req.log_dir.parent / "trainer_pids.txt").read_text().split()
    assert len(trainer_pids) == 3  # 2 ranks + the grandchild
    assert_no_survivors(req, at_least=4)


def test_interrupt_while_waiting_ends_the_tree_and_propagates(tmp_path: Path) -> None:
    req = make_request(tmp_path, "slow", steps=100, extra=("--sleep", "0.1"))

    def interrupt(record: dict[str, float]) -> bool:
        if record["step"] >= 2:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        LocalLauncher(kill_grace_s=2.0).launch(req, on_metrics=interrupt)
    assert_no_survivors(req, at_least=3)


def test_direct_job_failure_is_read_from_its_output(tmp_path: Path) -> None:
    script = tmp_path / "seed.py"
    script.write_text("import sys\nprint('starting')\nraise SystemExit('no seed: bad config')\n")
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    raise ValueError('bad seed config')\nf()\n")
    ok = LocalLauncher().launch(
        LaunchRequest(
            name="seed", entry=[str(script)], nproc=1, log_dir=tmp_path / "a", direct=True
        )
    )
    assert ok.status == "failed" and ok.returncode == 1
    res = LocalLauncher().launch(
        LaunchRequest(name="seed2", entry=[str(bad)], nproc=1, log_dir=tmp_path / "b", direct=True)
    )
    assert res.status == "failed" and res.failure is not None
    assert "ValueError: bad seed config" in res.failure.message
    assert res.failure.rank is None


def test_four_concurrent_jobs_do_not_collide_on_ports(tmp_path: Path) -> None:
    results: dict[str, JobResult] = {}

    def run(i: int) -> None:
        req = make_request(tmp_path, "ok", name=f"c{i}", steps=3)
        results[req.name] = LocalLauncher().launch(req)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == ["c0", "c1", "c2", "c3"]
    bad = {k: (r.status, r.failure) for k, r in results.items() if r.status != "ok"}
    assert bad == {}
    assert all(r.last_step == 3 for r in results.values())


def test_env_reaches_the_ranks(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import os\nprint('X=' + os.environ['MY_X'], 'OMP=' + "
        "os.environ['OMP_NUM_THREADS'], 'U=' + os.environ['PYTHONUNBUFFERED'])\n"
    )
    req = LaunchRequest(
        name="env",
        entry=[str(script)],
        nproc=1,
        log_dir=tmp_path / "l",
        env={"MY_X": "42"},
        direct=True,
    )
    assert LocalLauncher(python=sys.executable).launch(req).status == "ok"
    assert "X=42 OMP=1 U=1" in (tmp_path / "l" / "launcher.log").read_text()


def test_relaunch_in_same_folder_does_not_reuse_old_failure(tmp_path: Path) -> None:
    failed = LocalLauncher().launch(make_request(tmp_path, "raise_on_rank1", name="again"))
    assert failed.status == "failed"
    ok = LocalLauncher().launch(make_request(tmp_path, "ok", name="again"))
    assert ok.status == "ok"
    text = (ok.log_dir / "launcher.log").read_text()
    assert "Root Cause" not in text and "boom" not in text
    assert len(list((ok.log_dir / "ranks").glob("*/attempt_0"))) == 1


def test_stopped_agent_after_the_last_step_keeps_the_run(tmp_path: Path) -> None:
    """The agent is stopped (SIGSTOP) once the last step is logged, so the job never exits:
    the idle watchdog ends it, and the complete run is kept, not thrown away as hung."""
    import signal

    import psutil

    # The idle limit also covers torchrun's start-up: 5 s was seen too short on a loaded box.
    req = make_request(tmp_path, "ok", steps=3, idle_limit_s=15.0)

    def stop_agent_at_last_step(record: dict[str, float]) -> bool:
        if record.get("step") == 3:
            for child in psutil.Process().children():
                if "loopback_torchrun" in " ".join(child.cmdline()):
                    child.send_signal(signal.SIGSTOP)
        return False

    # torchrun's agent, found by its command line (a warm agent is the fork server's child).
    launcher = LocalLauncher(start="torchrun", kill_grace_s=2.0)
    result = launcher.launch(req, on_metrics=stop_agent_at_last_step)
    assert result.status == "ok", result
    assert result.last_step == 3
    assert result.failure is not None and "logged all 3 steps" in result.failure.message
    assert_no_survivors(req, at_least=1)


def test_a_standalone_job_listens_on_loopback_only(tmp_path: Path) -> None:
    """Every listening socket of a running job (the agent's rendezvous and bootstrap stores,
    the ranks' own) is bound to loopback, read from the kernel while the job trains."""
    import psutil

    # A second per step: the job is still alive when the watcher reports step 1 (at 0.02 s a
    # step, a loaded machine's poll saw step 1 only after the tree had exited).
    req = make_request(tmp_path, "slow", steps=3, extra=("--sleep", "1.0"))
    listening: list[tuple[str, str]] = []
    ifnames: list[tuple[str | None, str | None]] = []

    def look_at_step_1(record: dict[str, float]) -> bool:
        if record.get("step") == 1:
            # This job's torchrun tree only (a warm server of an earlier test is a child too).
            agents = [
                p
                for p in psutil.Process().children()
                if "loopback_torchrun" in " ".join(p.cmdline())
            ]
            for proc in [q for a in agents for q in (a, *a.children(recursive=True))]:
                try:
                    conns = proc.net_connections(kind="inet")
                    environ = proc.environ()
                except psutil.Error:
                    continue
                ifnames.append(
                    (environ.get("GLOO_SOCKET_IFNAME"), environ.get("NCCL_SOCKET_IFNAME"))
                )
                listening.extend(
                    (proc.name(), c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN
                )
        return False

    # torchrun's two stores; a warm rank's /proc environ is its server's (test below).
    result = LocalLauncher(start="torchrun").launch(req, on_metrics=look_at_step_1)
    assert result.status == "ok", result
    assert len(listening) >= 2, listening  # the agent hosts two stores
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::1"}, listening
    # gloo's and NCCL's own sockets follow these, whatever the hostname resolves to.
    assert ifnames and set(ifnames) == {(loopback_interface(), loopback_interface())}, ifnames


def test_a_warm_job_listens_on_loopback_only(tmp_path: Path) -> None:
    """The warm agent's store and the forked ranks' own sockets: loopback only, read from the
    kernel while the job trains."""
    import psutil

    # A second per step: the job is still alive when the watcher reports step 1 (at 0.02 s a
    # step, a loaded machine's poll saw step 1 only after the tree had exited).
    req = make_request(tmp_path, "slow", steps=3, extra=("--sleep", "1.0"))
    listening: list[str] = []

    def look_at_step_1(record: dict[str, float]) -> bool:
        if record.get("step") == 1:
            for proc in psutil.Process().children(recursive=True):
                try:
                    conns = proc.net_connections(kind="inet")
                except psutil.Error:
                    continue
                listening.extend(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN)
        return False

    result = LocalLauncher(start="warm").launch(req, on_metrics=look_at_step_1)
    assert result.status == "ok", result
    assert listening and set(listening) <= {"127.0.0.1", "::1"}, listening


def test_a_named_socket_interface_is_kept(tmp_path: Path) -> None:
    req = make_request(tmp_path, "ok", steps=3)
    env = local_job_env(req, {"GLOO_SOCKET_IFNAME": "eth7", "PATH": "/bin"})
    assert env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert env["NCCL_SOCKET_IFNAME"] == loopback_interface() == "lo"

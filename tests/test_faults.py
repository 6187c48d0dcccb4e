"""Fault injection at the pytest level (issue 7): a job that breaks never takes the pytest run
down, never leaves a process behind, and never loses or poisons a result.

Every case runs real pytest sessions in subprocesses, as a user would, on experiment files whose
jobs run ``tests/fixtures/faulty/trainer.py`` under real torchrun (command backend; the ranks
are stdlib-only so they start fast) or, for one case, the built-in trainer with a misbehaving
hook. Each case asserts the user-facing message, that the other pairs of the session ran and
passed, and -- by PID, from the launcher's ``logs/pids.json`` and the PIDs the ranks wrote --
that no process of any job is alive afterwards.

The sessions are shared by the tests that read them (module fixtures): one session holds
several faults side by side, which is also the point (the faults are contained).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from experiments import dumps, experiment_doc

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "faulty"))

from faulty_project import (
    NOTE,
    FaultyTest,
    alive,
    cache_entries,
    default_sigint,
    experiment,
    job_pids,
    kill_pids,
    make_project,
    odd_config,
    pytest_argv,
    run_dirs,
    run_pytest,
    saved_outcomes,
)

from convergence.cache.store import MANIFEST, RunCache

# Its module-scoped runs are shared by its tests: one xdist worker runs them all, so they
# run once per session, not once per worker (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("faults")

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug.toml"


@dataclass(frozen=True, kw_only=True)
class Session:
    project: Path
    proc: subprocess.CompletedProcess[str]
    outcomes: dict[str, dict]  # type: ignore[type-arg]

    @property
    def out(self) -> str:
        return self.proc.stdout

    @property
    def workdir(self) -> Path:
        return self.project / ".convergence"

    def run_dir(self, pair: str, side: str = "test") -> Path:
        found = [
            d
            for d in run_dirs(self.workdir)
            if d.parent.name.endswith(f"_{pair}") and d.name.startswith(f"{side}-")
        ]
        assert len(found) == 1, (pair, side, found)
        return found[0]

    def error(self, pair: str) -> str:
        return str(self.outcomes[pair]["error"] or "")


def _all_job_pids(workdir: Path) -> set[int]:
    pids: set[int] = set()
    for run_dir in run_dirs(workdir):
        pids |= job_pids(run_dir)
    return pids


def _assert_no_job_process_in(run_dir: Path) -> None:
    pids = job_pids(run_dir)
    assert pids, f"no PID was recorded in {run_dir}: the audit would prove nothing"
    left = alive(pids)
    kill_pids(left)
    assert not left, f"processes of {run_dir.name} still alive: {left}"


def _assert_no_job_process(workdir: Path) -> None:
    pids = _all_job_pids(workdir)
    assert pids, "no PID was recorded: the audit would prove nothing"
    left = alive(pids)
    kill_pids(left)
    assert not left, f"processes of finished jobs still alive: {left}"


@pytest.fixture(scope="module")
def squatter() -> Iterator[int]:
    """A listening socket on a port that the environment names as MASTER_PORT: a job that
    used it for its rendezvous would fail (EADDRINUSE) or hang."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


FAULTS = (
    FaultyTest(name="ok-first", argv_file=True),
    FaultyTest(
        name="raise-rank1", fault_args=("--fault", "raise", "--fault-rank", "1", "--at", "3")
    ),
    FaultyTest(
        name="nan-at-3", fault_args=("--fault", "nan", "--at", "3"), sleep=0.5, early_stop=False
    ),
    FaultyTest(
        name="sigkill-rank1", fault_args=("--fault", "sigkill", "--fault-rank", "1", "--at", "2")
    ),
    FaultyTest(name="ok-last"),
)
HANG = FaultyTest(
    name="hang-rank1", fault_args=("--fault", "hang", "--fault-rank", "1", "--at", "2")
)
STOPPED_RANK = FaultyTest(
    name="stopped-rank1", fault_args=("--fault", "sigstop", "--fault-rank", "1", "--at", "2")
)
STOPPED_AGENT = FaultyTest(
    name="stopped-agent", fault_args=("--fault", "stop_agent"), early_stop=False
)
IDLE_LIMIT_S = 30  # a loaded 2-core CI box: 3 jobs start side by side


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory, squatter: int) -> Iterator[Session]:
    """One session, two workers: raise / NaN / SIGKILL / NaN control next to good pairs."""
    root = tmp_path_factory.mktemp("faults")
    cfg = odd_config(root)
    project = make_project(
        root,
        {
            "faults.toml": experiment(tests=FAULTS, train_config=cfg),
            "nan_control.toml": experiment(
                tests=[FaultyTest(name="after-nan-control")],
                train_config=cfg,
                control_name="ddp2-nan",
                control_args=("--fault", "nan", "--at", "2"),
            ),
            "flat_control.toml": experiment(  # 20 steps: control health judges from MIN_STEPS on
                tests=[FaultyTest(name="after-flat-control")],
                train_config=cfg,
                steps=20,
                control_name="ddp2-flat",
                control_args=("--fault", "flat"),
            ),
        },
    )
    (project / "extra").mkdir()
    (project / "extra" / "hang.toml").write_text(
        experiment(tests=[HANG, STOPPED_RANK, STOPPED_AGENT], train_config=cfg)
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(squatter)}
    proc = run_pytest(
        project, "-n", "2", "--convergence-devices", "4", "--convergence-report", "report", env=env
    )
    session = Session(project=project, proc=proc, outcomes=saved_outcomes(project / ".convergence"))
    yield session
    kill_pids(_all_job_pids(session.workdir))


def test_faults_are_contained_and_good_pairs_pass(faults: Session) -> None:
    out = faults.out
    assert faults.proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "5 failed, 2 passed" in out.splitlines()[-1], out
    statuses = {name: o["status"] for name, o in faults.outcomes.items()}
    assert statuses == {
        "ok-first": "passed",
        "raise-rank1": "error",
        "nan-at-3": "failed",
        "sigkill-rank1": "error",
        "ok-last": "passed",
        "after-nan-control": "error",
        "after-flat-control": "error",
    }, out
    assert "PASSED experiments/faults.toml::ok-first" in out
    assert "PASSED experiments/faults.toml::ok-last" in out
    # The partial report of a session with faults is still written, every pair in it.
    report = json.loads((faults.project / "report" / "report.json").read_text())
    assert len(report["pairs"]) == 7
    _assert_no_job_process(faults.workdir)


def test_a_rank_that_raises_is_named_with_its_traceback(faults: Session) -> None:
    error = faults.error("raise-rank1")
    assert "test job 'raise-rank1'" in error
    assert "rank 1 failed: RuntimeError: injected fault on rank 1 at step 3" in error
    assert "Traceback (most recent call last)" in error and "trainer.py" in error
    assert (
        "faults.toml::raise-rank1: ERROR: test job 'raise-rank1' (ddp2) job "
        "'raise-rank1 test': rank 1 failed: RuntimeError: injected fault" in faults.out
    )
    assert not alive(job_pids(faults.run_dir("raise-rank1")))


def test_nan_loss_is_reported_at_its_step_and_the_job_is_stopped(faults: Session) -> None:
    outcome = faults.outcomes["nan-at-3"]
    assert "loss is nan at step 3" in faults.error("nan-at-3")
    assert (
        "faults.toml::nan-at-3: test job 'nan-at-3': job 'nan-at-3 test': loss is nan at "
        "step 3" in faults.out
    )
    result = outcome["test"]["result"]
    assert result["status"] == "nan" and result["failure"]["step"] == 3
    # Stopped, not run out: 6 steps at 0.5 s each would take 3 s more.
    assert result["last_step"] < 6, result
    assert not alive(job_pids(faults.run_dir("nan-at-3")))


def test_a_control_that_does_not_learn_errors_the_pair(faults: Session) -> None:
    """A flat control certifies nothing: the pair is an error that says so (stats.health)."""
    outcome = faults.outcomes["after-flat-control"]
    assert outcome["status"] == "error", outcome
    error = faults.error("after-flat-control")
    assert "control job 'ddp2-flat'" in error and "did not learn" in error, error
    assert "flat_control.toml::after-flat-control: ERROR: control job 'ddp2-flat'" in faults.out


def test_a_nan_control_errors_the_pair_and_is_never_cached(faults: Session) -> None:
    error = faults.error("after-nan-control")
    assert "control job 'ddp2-nan'" in error and "loss is nan at step 2" in error
    # The NaN control is never cached: it would poison every later session. (The finished
    # flat control of flat_control.toml is: a faithful run, judged unhealthy on every use.)
    cache = RunCache(faults.workdir / "cache")
    assert cache_entries(faults.workdir / "cache", "ddp2-nan") == []
    good = cache_entries(faults.workdir / "cache", "ddp2")
    assert len(good) == 1, good
    assert cache.verify(good[0]) is None


def test_a_rank_killed_by_a_signal_is_reported_as_such(faults: Session) -> None:
    error = faults.error("sigkill-rank1")
    assert "rank 1 was killed by SIGKILL (out of memory?)" in error
    assert "sigkill-rank1 test': rank 1 was killed by SIGKILL" in faults.out
    assert not alive(job_pids(faults.run_dir("sigkill-rank1")))


def test_a_taken_rendezvous_port_does_not_matter(faults: Session, squatter: int) -> None:
    """MASTER_PORT names a port something else listens on; the jobs rendezvous on a port the
    OS picks (c10d on port 0), so every good pair still ran."""
    with pytest.raises(OSError):  # the squatter still holds it
        socket.create_server(("127.0.0.1", squatter)).close()
    assert faults.outcomes["ok-first"]["status"] == "passed"
    launcher_log = (faults.run_dir("ok-first") / "logs" / "launcher.log").read_text()
    # torchrun's rendezvous on port 0, or the warm agent's store on a port the OS picked
    assert (
        "'--rdzv-endpoint', 'localhost:0'" in launcher_log
        or f"store on 127.0.0.1:{squatter}" not in launcher_log
        and "# warm agent:" in launcher_log
    )


def test_toml_values_never_go_through_a_shell(faults: Session) -> None:
    """A train-config path full of shell syntax and a literal with ``; rm -rf`` arrive as one
    argv word each; the launcher records an argv list, and no canary file appears."""
    run = faults.run_dir("ok-first")
    argv = json.loads((run / "dump" / "argv.json").read_text())
    assert argv[argv.index("--note") + 1] == NOTE
    assert argv[argv.index("--config") + 1] == str(odd_config(faults.project))
    first = (run / "logs" / "launcher.log").read_text().splitlines()[0]
    assert first.startswith("# argv: [") and repr(NOTE) in first
    for folder in (faults.project, REPO, Path.cwd()):
        assert not list(folder.glob("CANARY*")), folder


def test_hung_and_stopped_jobs_are_ended_by_the_watchdog(faults: Session) -> None:
    """One session, three jobs that stop making progress, side by side (-n 3):
    - rank 1 sleeps (with a detached grandchild) while rank 0 waits for it in the barrier: the
      no-progress watchdog (--convergence-idle-limit) ends the job;
    - rank 1 is stopped (SIGSTOP): the message names the rank and its pid;
    - the torchrun agent is stopped after every step was logged: the run is complete, so it is
      kept and the pair passes.
    No process of any of them is left."""
    proc = run_pytest(
        faults.project,
        "extra/hang.toml",
        "-n",
        "3",
        "--convergence-devices",
        "6",
        f"--convergence-idle-limit={IDLE_LIMIT_S}",
        "--convergence-wall-limit=300",
    )
    out = proc.stdout
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "2 failed, 1 passed" in out.splitlines()[-1], out
    assert (
        "hang.toml::hang-rank1: ERROR: test job 'hang-rank1' (ddp2) job 'hang-rank1 test' "
        "hung: no new line in"
    ) in out, out
    assert f"for {IDLE_LIMIT_S} s" in out
    outcomes = saved_outcomes(faults.workdir)
    stopped = str(outcomes["stopped-rank1"]["error"] or "")
    assert outcomes["stopped-rank1"]["status"] == "error" and "hung: no new line" in stopped
    rank1_pid = int((faults.run_dir("stopped-rank1") / "dump" / "pids" / "rank1.pid").read_text())
    assert f"rank 1 (pid {rank1_pid}) is stopped (SIGSTOP or a debugger)" in stopped, stopped
    assert outcomes["stopped-agent"]["status"] == "passed", outcomes["stopped-agent"]
    agent_log = faults.run_dir("stopped-agent") / "logs" / "launcher.log"
    assert "logged all 6 steps" in agent_log.read_text()
    for pair in ("stopped-rank1", "stopped-agent"):
        _assert_no_job_process_in(faults.run_dir(pair))
    run = faults.run_dir("hang-rank1")
    pids = job_pids(run)
    grandchild = run / "dump" / "pids" / "grandchild.pid"
    if grandchild.exists():  # the job reached step 2 before the limit (not on a loaded box)
        assert int(grandchild.read_text()) in pids
    left = alive(pids)
    kill_pids(left)
    assert not left


def test_a_corrupt_cache_entry_is_detected_and_rerun(faults: Session) -> None:
    """Truncate a file of the cached control: the next session does not trust it, reruns the
    control, stores a verified entry again, and the pair passes."""
    cache_root = faults.workdir / "cache"
    entries = cache_entries(cache_root, "ddp2")
    assert len(entries) == 1
    metrics = entries[0] / "dump" / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-20])  # a truncated copy, manifest unchanged
    proc = run_pytest(faults.project, "experiments/faults.toml::ok-last")
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout
    outcome = saved_outcomes(faults.workdir)["ok-last"]
    assert outcome["status"] == "passed"
    assert outcome["control"]["cached"] is False, "a corrupt entry was trusted"
    assert "[ddp2 control] step" in proc.stdout  # it really ran again
    assert RunCache.verify(entries[0]) is None  # the fresh entry replaced the corrupt one
    assert (entries[0] / MANIFEST).is_file()


# -- Ctrl-C ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "workers",
    [
        pytest.param(None, id="one-process"),
        pytest.param(2, id="xdist", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_ends_every_job_and_keeps_finished_runs(tmp_path: Path, workers: int | None) -> None:
    """SIGINT while a job trains: pytest ends as interrupted, every process of every job is
    gone (by PID), the finished control stays in the cache and the report holds the finished
    pair. With xdist the signal goes to the whole process group, as a terminal's Ctrl-C does.
    (tests/test_plugin_e2e.py has the same on the built-in trainer, without the PID audit.)"""
    tests = [FaultyTest(name="quick"), FaultyTest(name="long", sleep=20.0, early_stop=False)]
    project = make_project(
        tmp_path, {"c.toml": experiment(tests=tests, train_config=odd_config(tmp_path))}
    )
    args = ["--convergence-report", "report", "-v"]
    if workers:  # both pairs at once: wait for the quick one to finish first
        args += ["-n", str(workers), "--convergence-devices", "4"]
    proc = subprocess.Popen(
        pytest_argv(*args),
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "COLUMNS": "200"},
        preexec_fn=default_sigint,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    long_pids = project / ".convergence" / "runs" / "c.toml_long"
    try:
        deadline = time.monotonic() + 300
        quick_done = False
        for line in proc.stdout:
            lines.append(line)
            quick_done = (
                quick_done
                or "c.toml::quick PASSED" in line
                or ("PASSED" in line and "quick" in line)
            )
            if quick_done and list(long_pids.glob("test-*/dump/pids/rank1.pid")):
                break
            assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.5)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        if workers:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out = "".join(lines) + proc.stdout.read()
        code = proc.wait(timeout=120)
        # xdist's controller may die of the group's SIGINT while tearing down its workers
        # (execnet): a known xdist behaviour; what we own is checked below either way.
        assert code == pytest.ExitCode.INTERRUPTED or (workers and code == -signal.SIGINT), out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    workdir = project / ".convergence"
    long_run = next(long_pids.glob("test-*"))
    pids = job_pids(long_run) | {p.pid for p in descendants}
    assert len(job_pids(long_run)) >= 3, "agent and both ranks must be on record"
    left = alive(pids)
    kill_pids(left)
    assert not left, out
    # The finished control stays in the cache, whole.
    entries = [p for p in (workdir / "cache").glob("??/*") if p.is_dir()]
    assert len(entries) == 1 and RunCache.verify(entries[0]) is None
    if code != pytest.ExitCode.INTERRUPTED:
        return
    report = json.loads((project / "report" / "report.json").read_text())
    # The finished pair as it finished; the pair in flight listed as interrupted, not dropped.
    by_name = {p["name"]: p for p in report["pairs"]}
    assert by_name.pop("quick")["status"] == "passed", out
    assert [(p["status"], "interrupted" in p["error"]) for p in by_name.values()] == [
        ("error", True)
    ], out
    assert report["environment"]["interrupted"] is True


# -- disk full ------------------------------------------------------------------------------


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.decode().strip()}")


def _fill(folder: Path) -> None:
    try:
        with open(folder / "filler.bin", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass


@pytest.fixture
def small_disks(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Three real tmpfs: the workdir (runs, metrics), a small cache, a full report folder."""
    mounts = {
        "work": tmp_path / f"work-{uuid.uuid4().hex[:6]}",
        "cache": tmp_path / "cache",
        "report": tmp_path / "report",
    }
    done: list[Path] = []
    try:
        for name, size in (("work", "8m"), ("cache", "512k"), ("report", "64k")):
            _mount_tmpfs(mounts[name], size)
            done.append(mounts[name])
        yield mounts
    finally:
        for path in reversed(done):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_disk_full_is_a_clear_error_and_leaves_no_half_cache_entry(
    tmp_path: Path, small_disks: dict[str, Path]
) -> None:
    """The metrics' disk fills up mid-run -> that pair errors with ENOSPC on its rank; a
    control too big for the cache's disk -> that pair errors "disk full ... nothing was
    stored"; the report's disk is full -> a clear line at the end. The other pairs pass."""
    cfg = odd_config(tmp_path / "p")
    project = make_project(
        tmp_path / "p",
        {
            "disk.toml": experiment(
                train_config=cfg,
                tests=[
                    FaultyTest(name="ok"),
                    FaultyTest(
                        name="metrics-disk-full", fault_args=("--fault", "diskfull", "--at", "2")
                    ),
                    FaultyTest(name="ok-after"),
                ],
            ),
            "big_control.toml": experiment(
                train_config=cfg,
                tests=[FaultyTest(name="after-big-control")],
                control_name="ddp2-big",
                control_args=("--fault", "blob", "--blob-kib", "1024"),
            ),
        },
    )
    _fill(small_disks["report"])
    proc = run_pytest(
        project,
        f"--convergence-workdir={small_disks['work']}",
        f"--convergence-cache-dir={small_disks['cache']}",
        f"--convergence-report={small_disks['report'] / 'out'}",
    )
    out = proc.stdout
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    outcomes = saved_outcomes(small_disks["work"])
    assert {n: o["status"] for n, o in outcomes.items()} == {
        "ok": "passed",
        "metrics-disk-full": "error",
        "ok-after": "passed",
        "after-big-control": "error",
    }, out
    assert (
        "metrics-disk-full test': rank 0 failed: OSError: [Errno 28] No space left on device"
    ) in outcomes["metrics-disk-full"]["error"]
    big = outcomes["after-big-control"]["error"]
    assert "disk full while storing run" in big and "nothing was stored" in big, big
    assert "--convergence-cache-dir" in big
    assert "convergence: writing the reports failed: OSError: [Errno 28] No space left" in out
    # The cache holds the good control, verified, and no half-written entry or temp folder.
    cache = small_disks["cache"]
    entries = [p for p in cache.glob("??/*") if p.is_dir()]
    assert len(entries) == 1 and RunCache.verify(entries[0]) is None, entries
    assert list((cache / ".tmp").iterdir()) == []
    _assert_no_job_process(small_disks["work"])


# -- the built-in trainer with a misbehaving hook ---------------------------------------------

RAISING_HOOK = '''
import torch.distributed as dist


def raise_on_rank1(model, ctx):
    """Rank 1 raises in its third forward pass (step 3), in the middle of FSDP's collectives."""
    calls = {"n": 0}

    def pre_forward(module, args):
        calls["n"] += 1
        if dist.get_rank() == 1 and calls["n"] == 3:
            raise RuntimeError("hook fault on rank 1 at step 3")

    model.register_forward_pre_hook(pre_forward)
    return None
'''


def test_builtin_trainer_rank_raising_in_a_hook(tmp_path: Path) -> None:
    project = make_project(
        tmp_path,
        {
            "builtin.toml": dumps(
                experiment_doc(
                    defaults={"train_config": str(DEBUG), "steps": 5, "seed": 3},
                    control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
                    tests=[
                        {
                            "name": "hook-raises",
                            "parallelism": {"dp_shard": 2},
                            "hook": "raising_hook:raise_on_rank1",
                        }
                    ],
                )
            )
        },
    )
    (project / "raising_hook.py").write_text(RAISING_HOOK)
    (project / "test_after.py").write_text("def test_after_the_fault():\n    pass\n")
    proc = run_pytest(project, "experiments", "test_after.py", "-m", "")
    out = proc.stdout
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "PASSED test_after.py::test_after_the_fault" in out, out
    outcome = saved_outcomes(project / ".convergence")["hook-raises"]
    error = outcome["error"]
    assert "rank 1 failed: RuntimeError: hook fault on rank 1 at step 3" in error, error
    assert "raising_hook.py" in error  # the traceback reaches into the user's hook
    assert outcome["control"] is not None and outcome["control"]["cached"] is False
    _assert_no_job_process(project / ".convergence")


# -- bad input at collection -----------------------------------------------------------------


def _bad(test: dict[str, object], train_config: str = str(DEBUG)) -> str:
    """A valid control (FSDP on 2 ranks, 4 steps) and the bad test ``test``."""
    return dumps(
        experiment_doc(
            defaults={"train_config": train_config, "steps": 4},
            control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
            tests=[{"name": "x", **test}],
        )
    )


BAD_INPUT = {
    # file name: (experiment text, substrings the collection error must show)
    # Broken on purpose: the test's header loses a bracket (what the writer never writes).
    "malformed.toml": (_bad({}).replace("[[test]]", "[[test]", 1), ["malformed TOML", "fix:"]),
    "unknown_key.toml": (
        _bad({"tensor_paralel": 2}),
        ["key 'test[0].tensor_paralel'", "unknown key", "fix:"],
    ),
    "wrong_type.toml": (
        _bad({"steps": "ten"}),
        ["key 'test[0].steps'", "expected an integer", "fix:"],
    ),
    "impossible.toml": (
        _bad({"parallelism": {"dp_shard": 1, "tp": 3}}),
        ["key 'test[0].parallelism.tp'", "tp=3 must divide", "fix:"],
    ),
    "tokens.toml": (
        _bad({"parallelism": {"dp_shard": 4}}),
        [
            "key 'test[0].local_batch_size'",
            "tokens per optimizer step differ",
            "fix: set local_batch_size = 4",
        ],
    ),
    "bad_hook.toml": (
        _bad({"parallelism": {"dp_shard": 2}, "hook": "no_such_pkg_7.par:apply"}),
        ["key 'test[0].hook'", "hook module 'no_such_pkg_7.par' cannot be imported", "fix:"],
    ),
    "no_config.toml": (
        _bad({"parallelism": {"dp_replicate": 2}}, train_config="train_configs/nope.toml"),
        ["key 'control.train_config'", "does not exist", "fix:"],
    ),
    # Too many devices for the session is not bad input but a skip (test_plugin_collection).
}


def test_bad_input_fails_at_collection_and_launches_nothing(tmp_path: Path) -> None:
    project = make_project(tmp_path, {name: text for name, (text, _) in BAD_INPUT.items()})
    proc = run_pytest(project, "--convergence-devices", "4")
    out = proc.stdout
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert f"{len(BAD_INPUT)} errors during collection" in out, out
    for name, (_, expected) in BAD_INPUT.items():
        section = out.split(f"ERROR collecting experiments/{name} ")[1].split("\n", 1)[1]
        section = section.split("\n___")[0].split("\n===")[0]
        assert "invalid experiment (nothing was launched)" in section, (name, section)
        assert f"experiments/{name}" in section, (name, section)
        for text in expected:
            assert text in section, (name, text, section)
        assert "Traceback" not in section, section
    assert not (project / ".convergence" / "runs").exists()

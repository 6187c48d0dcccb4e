"""torchrun argv, environment, and parsing of torchrun's failure report (the adapter,
launch/torchrun_report.py; unit level)."""

from __future__ import annotations

import json
from pathlib import Path

from convergence.launch.failure import diagnose, error_file_traceback, last_traceback
from convergence.launch.rank_exits import signal_name
from convergence.launch.torchrun import build_torchrun_argv, job_env
from convergence.launch.torchrun_report import parse_root_cause
from convergence.launch.types import LaunchRequest
from convergence.launch.watch import record_loss

# Verbatim tail of torch 2.13's agent output when rank 1 was SIGKILLed (rank 0 then SIGTERMed).
SIGKILL_REPORT = """\
Failures:
[1]:
  time      : 2026-11-22_05:14:24
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5028)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 5028
--------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:14:24
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5029)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 5029
========================================================
"""


def test_torchrun_argv_is_a_list_with_free_port_rendezvous(tmp_path: Path) -> None:
    req = LaunchRequest(
        name="fsdp2 tp2/x",
        entry=["-m", "convergence.trainer", "--config", "a b.toml"],
        nproc=4,
        log_dir=tmp_path,
    )
    argv = build_torchrun_argv(req, python="/py")
    assert argv == [
        "/py",
        "-m",
        "convergence.launch.loopback_torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--rdzv-id",
        "fsdp2-tp2-x",
        "--log-dir",
        str(tmp_path / "ranks"),
        "--redirects",
        "3",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.02",
        "-m",
        "convergence.trainer",
        "--config",
        "a b.toml",
    ]


def test_direct_argv_skips_torchrun(tmp_path: Path) -> None:
    req = LaunchRequest(name="seed", entry=["-m", "x.seed"], nproc=1, log_dir=tmp_path, direct=True)
    assert build_torchrun_argv(req, python="/py") == ["/py", "-m", "x.seed"]


def test_env_keeps_a_chosen_thread_count(tmp_path: Path) -> None:
    req = LaunchRequest(
        name="j", entry=[], nproc=1, log_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    env = job_env(req, base={"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert job_env(req, base={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_root_cause_block_names_the_killed_rank_not_the_terminated_one() -> None:
    cause = parse_root_cause("noise\n" + SIGKILL_REPORT)
    assert cause is not None
    assert (cause.rank, cause.local_rank, cause.exitcode, cause.signal) == (1, 1, -9, "SIGKILL")
    assert cause.error_file is None
    assert parse_root_cause("no report here") is None


def test_diagnose_reads_error_file_named_in_the_report(tmp_path: Path) -> None:
    err = tmp_path / "ranks" / "r_1" / "attempt_0" / "1" / "error.json"
    err.parent.mkdir(parents=True)
    err.write_text(
        json.dumps(
            {
                "message": {
                    "message": "ValueError: x",
                    "extraInfo": {
                        "py_callstack": "Traceback (most recent call last):\n  ...\nValueError: x\n"
                    },
                }
            }
        )
    )
    report = SIGKILL_REPORT.replace("-9 (pid: 5029)  (SIGKILL)", "1 (pid: 5029)").replace(
        "error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 5029",
        f"error_file: {err}\n  traceback : Traceback (most recent call last):\n   "
        "Signal 9 (SIGKILL) mentioned by user code",
    )
    (tmp_path / "launcher.log").write_text(report)
    info = diagnose(tmp_path, name="j", returncode=1)
    assert info.rank == 1 and info.signal is None
    assert info.traceback.endswith("ValueError: x\n")
    assert info.message == "job 'j': rank 1 failed: ValueError: x"


def test_diagnose_without_report_scans_rank_logs(tmp_path: Path) -> None:
    log = tmp_path / "ranks" / "r_1" / "attempt_0" / "3" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("warn\nTraceback (most recent call last):\n  File x\nKeyError: 'k'\n")
    info = diagnose(tmp_path, name="j", returncode=1)
    assert info.rank == 3 and "KeyError: 'k'" in info.message


def test_helpers() -> None:
    assert signal_name(-9) == "SIGKILL" and signal_name(1) is None and signal_name(None) is None
    assert (
        last_traceback("a\nTraceback (most recent call last):\nX\n")
        == "Traceback (most recent call last):\nX\n"
    )
    assert last_traceback("clean") == ""
    assert error_file_traceback(Path("/nonexistent/error.json")) == ""
    assert record_loss({"step": 1, "loss_metrics/global_avg_loss": 2.5}) == 2.5
    assert record_loss({"step": 1, "loss": 1.0, "z_loss": 9.0}) == 1.0
    assert record_loss({"step": 1, "lr": 0.1}) is None


def test_a_sigtermed_root_cause_gives_way_to_the_real_failure() -> None:
    # torchrun's tie on whole-second timestamps can name the rank it terminated itself.
    swapped = (
        SIGKILL_REPORT.replace("rank      : 0 (local_rank: 0)", "rank      : @")
        .replace("rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)")
        .replace("rank      : @", "rank      : 1 (local_rank: 1)")
    )
    swapped = (
        swapped.replace("exitcode  : -15 (pid: 5028)  (SIGTERM)", "exitcode  : @")
        .replace("exitcode  : -9 (pid: 5029)  (SIGKILL)", "exitcode  : -15 (pid: 5028)  (SIGTERM)")
        .replace("exitcode  : @", "exitcode  : -9 (pid: 5029)  (SIGKILL)")
    )
    cause = parse_root_cause(swapped)
    assert cause is not None and (cause.rank, cause.signal) == (1, "SIGKILL")


TIED_REPORT = """\
Failures:
[1]:
  time      : 2026-11-24_05:22:18
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 8793)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
--------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_05:22:18
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 8792)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
========================================================
"""


def _rank_log(root: Path, local_rank: int, last_line: str) -> None:
    log = root / "ranks" / "r_1" / "attempt_0" / str(local_rank) / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        f"[rank{local_rank}]: Traceback (most recent call last):\n"
        f'[rank{local_rank}]:   File "train.py", line 3, in step\n'
        f"[rank{local_rank}]: {last_line}\n"
    )


def test_the_rank_that_failed_by_itself_is_blamed_not_the_peer_that_lost_it(tmp_path: Path) -> None:
    """Rank 1 raised in a hook; rank 0 then saw gloo's "Connection closed by peer" and exited
    in the same second, and torchrun named rank 0. The message must name rank 1's error (seen
    in CI: the hook-fault test failed on this tie)."""
    (tmp_path / "launcher.log").write_text(TIED_REPORT)
    _rank_log(
        tmp_path,
        0,
        "RuntimeError: [/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:23938. This is typically caused by a remote "
        "worker crashing.",
    )
    _rank_log(tmp_path, 1, "RuntimeError: hook fault on rank 1 at step 3")
    info = diagnose(tmp_path, name="j", returncode=1)
    assert info.rank == 1
    assert info.message == "job 'j': rank 1 failed: RuntimeError: hook fault on rank 1 at step 3"
    # Without torchrun's report the rank logs are scanned the same way.
    (tmp_path / "launcher.log").write_text("no report\n")
    assert diagnose(tmp_path, name="j", returncode=1).rank == 1
    # Only peer-gone errors: the named rank stays the one to look at.
    (tmp_path / "launcher.log").write_text(TIED_REPORT)
    _rank_log_path = tmp_path / "ranks" / "r_1" / "attempt_0" / "1" / "stderr.log"
    _rank_log_path.write_text(
        "Traceback (most recent call last):\nRuntimeError: Connection reset by peer\n"
    )
    assert diagnose(tmp_path, name="j", returncode=1).rank == 0


def test_every_rendezvous_goes_through_the_wrapper() -> None:
    from convergence.launch.torchrun import torchrun_module

    assert torchrun_module("localhost:0") == "convergence.launch.loopback_torchrun"
    assert torchrun_module("127.0.0.1:29500") == "convergence.launch.loopback_torchrun"
    assert torchrun_module("node017:29500") == "convergence.launch.loopback_torchrun"

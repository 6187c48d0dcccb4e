"""The Slurm launcher against a real one-node Slurm (tests/slurm_cluster.py).

A command-backend pair (tests/fixtures/command_trainer/train.py, DDP 1 vs 2 ranks) runs with
the local launcher, through srun steps of an allocation, and through sbatch (the nightly
script); the curves must be bitwise identical. Skipped, with the reason, where Slurm cannot be
installed or started (not root, apt fails, daemons refuse to start).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from convergence.launch.slurm import PORT_BASE, PORT_SPAN, PortAllocator, SlurmError, SlurmLauncher
from convergence.launch.types import LaunchRequest
from convergence.metrics.curve import RunMetrics
from convergence.preflight import load_checked
from convergence.run.outcome import PairOutcome
from convergence.run.runner import Runner, RunSettings
from convergence.spec.pair import PairSpec
from experiments import command_pair, fixture_command

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import SlurmCluster, running, start_cluster

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6

# Under `pytest -n N` every test of this file goes to one worker (--dist loadgroup, as .ci/run
# runs), and the cluster lives for this module only: the host-wide lock (slurm_cluster.LOCK) is held
# while these tests run, not for the rest of a worker's session (a second suite beside this
# one, or another worker, waits minutes, not the whole run).
pytestmark = pytest.mark.xdist_group("slurm")


def _experiment(folder: Path) -> Path:
    return command_pair(
        folder,
        file="slurm_cmd.toml",
        command=fixture_command(),
        compare=None,
        steps=STEPS,
        seed=7,
        control={"name": "ddp1", "parallelism": {"dp_replicate": 1}, "local_batch_size": 2},
        tests=[
            {
                "name": "ddp2",
                "parallelism": {"dp_replicate": 2},
                "local_batch_size": 1,
                "early_stop": False,
            }
        ],
    )


def _pair(folder: Path) -> PairSpec:
    pairs = load_checked(_experiment(folder), rootdir=ROOT).pairs
    assert len(pairs) == 1
    return pairs[0]


def _curves(metrics: RunMetrics) -> dict[str, list[float]]:
    return {name: [float(v) for v in metrics[name].values] for name in ("loss", "grad_norm")}


def _step_names(cluster: SlurmCluster) -> list[str]:
    out = cluster.run("squeue", "--steps", "-h", "-o", "%j", check=False).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def _alive_with(token: str) -> list[int]:
    """PIDs of live processes whose command line holds ``token`` (a unique marker)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if token in cmd and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(proc.pid)
    return found


# -- no Slurm needed -------------------------------------------------------------------------


def test_outside_an_allocation_is_a_clear_error() -> None:
    with pytest.raises(SlurmError) as info:
        SlurmLauncher(environ={"PATH": os.environ.get("PATH", "")})
    text = str(info.value)
    assert "SLURM_JOB_ID" in text and "salloc" in text and "--convergence-launcher" in text


def test_ports_are_distinct_across_concurrent_launches(tmp_path: Path) -> None:
    allocators = [PortAllocator("4242", tmp_path) for _ in range(4)]  # 4 "xdist workers"
    got: list[int] = []

    def take(alloc: PortAllocator) -> None:
        for _ in range(25):
            got.append(alloc.next(probe=False)[0])

    threads = [threading.Thread(target=take, args=(a,)) for a in allocators]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 100 and len(set(got)) == 100
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in got)
    # Another allocation on the same node starts elsewhere in the range.
    assert PortAllocator("4243", tmp_path).port_for(0) != PortAllocator("4242", tmp_path).port_for(
        0
    )


def test_port_probe_skips_a_port_in_use(tmp_path: Path) -> None:
    alloc = PortAllocator("777", tmp_path)
    with socket.socket() as busy:
        busy.bind(("", alloc.port_for(0)))
        busy.listen()
        port, n = alloc.next(probe=True)
    assert port == alloc.port_for(1) and n == 1


# -- a real one-node Slurm -------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with running(lambda: start_cluster(tmp_path_factory.mktemp("slurm")), what="real Slurm") as c:
        yield c


@pytest.fixture
def allocation(slurm: SlurmCluster) -> Iterator[dict[str, str]]:
    """An allocation made without a shell (``salloc --no-shell``): this test process plays
    the batch script, its launcher attaches with ``srun --jobid``. One per test, cancelled at
    its end: it holds a CPU of the node's two, and the sbatch test below needs both (with a
    module-scoped allocation, that test waited for its CPUs until it timed out, whenever it
    ran after the tests that use one)."""
    done = slurm.run("salloc", "--no-shell", "-N", "1", "-c", "1", "-J", "conv-tests", timeout=60)
    match = re.search(r"allocation (\d+)", done.stderr + done.stdout)
    assert match, done.stderr
    job = match.group(1)
    try:
        yield {**os.environ, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": slurm.node}
    finally:
        slurm.run("scancel", job, check=False)


@pytest.fixture(scope="module")
def local_outcome(tmp_path_factory: pytest.TempPathFactory) -> PairOutcome:
    """The reference: the same pair with the local launcher."""
    work = tmp_path_factory.mktemp("local")
    outcome = Runner(RunSettings(work_dir=work / "work", devices=2)).run_pair(_pair(work))
    assert outcome.status == "passed", outcome.error
    return outcome


def test_plan_takes_nodes_head_and_port_from_the_allocation(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    env = {**os.environ, "SLURM_JOB_ID": "99", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    launcher = SlurmLauncher(environ=env, procs_per_node=2, state_dir=tmp_path)
    assert launcher.allocation.hosts == ("gpu07", "gpu08")
    request = LaunchRequest(
        name="fsdp4 test",
        entry=["-m", "x"],
        nproc=4,
        log_dir=tmp_path / "logs",
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
    )
    launcher._local.plan = plan = launcher.plan(request)
    argv = launcher.build_argv(request)
    text = " ".join(argv)
    assert argv[0] == "srun" and "--jobid 99" in text
    assert "--nodes 2 --ntasks 2 --ntasks-per-node 1 --nodelist gpu07,gpu08" in text
    assert f"--rdzv-endpoint gpu07:{plan.port}" in text
    assert "--nnodes 2 --nproc-per-node 2" in text and "--overlap" in text
    # A second job of the same allocation gets another port; 1 node suffices for 2 ranks.
    other = launcher.plan(
        LaunchRequest(name="b", entry=["-m", "x"], nproc=2, log_dir=tmp_path / "b")
    )
    assert other.port != plan.port and other.hosts == ("gpu07",)
    with pytest.raises(SlurmError, match="needs 3 nodes"):
        launcher.num_nodes(6)


def test_pair_through_srun_is_identical_to_local(
    slurm: SlurmCluster, allocation: dict[str, str], local_outcome: PairOutcome, tmp_path: Path
) -> None:
    launcher = SlurmLauncher(environ=allocation, state_dir=tmp_path / "state")
    runner = Runner(RunSettings(work_dir=tmp_path / "work", devices=2), launcher=launcher)
    outcome = runner.run_pair(_pair(tmp_path))
    assert outcome.status == "passed", outcome.error
    assert outcome.control is not None and outcome.test is not None
    assert local_outcome.control is not None and local_outcome.test is not None
    assert _curves(outcome.control.metrics) == _curves(local_outcome.control.metrics)
    assert _curves(outcome.test.metrics) == _curves(local_outcome.test.metrics)
    assert len(_curves(outcome.test.metrics)["loss"]) == STEPS
    assert outcome.test.run_dir is not None
    log = (outcome.test.run_dir / "logs" / "launcher.log").read_text()
    assert "'srun', '--jobid', " + repr(allocation["SLURM_JOB_ID"]) in log
    assert not [s for s in _step_names(slurm) if s.startswith("conv-")]


def test_srun_failure_is_diagnosed_and_timeout_leaves_nothing(
    slurm: SlurmCluster, allocation: dict[str, str], tmp_path: Path
) -> None:
    launcher = SlurmLauncher(environ=allocation, state_dir=tmp_path / "state", kill_grace_s=3.0)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os, sys\nif os.environ['RANK'] == '1':\n"
        "    raise ValueError('planted failure on rank one')\n"
    )
    result = launcher.launch(
        LaunchRequest(name="bad", entry=[str(bad)], nproc=2, log_dir=tmp_path / "bad")
    )
    assert result.status == "failed" and result.failure is not None
    assert result.failure.rank == 1
    assert "planted failure on rank one" in result.failure.message

    token = f"conv-hang-{time.time_ns()}"
    hung = launcher.launch(
        LaunchRequest(
            name="hang",
            entry=["-c", f"import time; time.sleep(300)  # {token}"],
            nproc=1,
            log_dir=tmp_path / "hang",
            direct=True,
            wall_limit_s=3.0,
        )
    )
    assert hung.status == "timeout"  # the 3 s wall limit ended it, not the 300 s sleep
    assert not [s for s in _step_names(slurm) if s.startswith("conv-")]
    assert not _alive_with(token)


def test_pair_through_sbatch_nightly_is_identical_to_local(
    slurm: SlurmCluster, local_outcome: PairOutcome, tmp_path: Path
) -> None:
    import json

    from convergence.calibration.file import Calibration, default_path, write_calibration
    from convergence.calibration.stack import current_stack, stack_hash
    from convergence.cli import main

    experiment = _experiment(tmp_path / "experiments")
    out = tmp_path / "nightly"
    script = out / "nightly.sbatch"
    # The night's calibration step runs, and finds this stack's file already there (no floors
    # in it: the shipped ones apply): measuring them is `convergence calibrate`'s own test
    # (tests/test_calibration.py), ~100 CPU s that CI's 2 cores need elsewhere (issue 48).
    stack = current_stack()
    write_calibration(
        Calibration(
            stack_hash=stack_hash(stack), stack=stack, obtained={"source": "written by a test"}
        ),
        default_path(tmp_path / "work", stack_hash(stack)),
    )
    assert (
        main(
            [
                "nightly",
                "--experiments",
                str(experiment),
                "--out",
                str(out),
                "--rootdir",
                str(ROOT),
                "--no-exclusive",
                "--time",
                "00:10:00",
                "--sbatch-option=--cpus-per-task=2",  # the pool: 2 CPU slots
                "--pytest-args",
                f"--convergence-workdir {tmp_path / 'work'} --convergence-devices 2 -q",
            ]
        )
        == 0
    )
    done = subprocess.run(
        ["sbatch", "--wait", str(script)],
        env=slurm.env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    slurm_out = "\n".join(p.read_text() for p in out.glob("slurm-*.out"))
    assert done.returncode == 0, f"{done.stderr}\n{slurm_out}"
    assert "nothing to do" in slurm_out, slurm_out  # the calibration step ran and found the file
    nights = list((out / "nights").iterdir())
    assert len(nights) == 1
    assert (nights[0] / "junit.xml").read_text().count("<testcase") == 1
    report = json.loads((nights[0] / "report" / "report.json").read_text())
    pair = report["pairs"][0]
    assert pair["status"] == "passed"
    assert local_outcome.control is not None and local_outcome.test is not None
    for side, local in (("control", local_outcome.control), ("test", local_outcome.test)):
        values = [float(v) for v in pair["curves"][side]["loss"]["values"]]
        assert values == _curves(local.metrics)["loss"], side
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["status"] == "passed"
    assert history[0]["night"] == nights[0].name and history[0]["pytest_status"] == 0
    expected = (
        _curves(local_outcome.test.metrics)["loss"][-1]
        - _curves(local_outcome.control.metrics)["loss"][-1]
    )
    assert history[0]["final_loss_delta"] == pytest.approx(expected, abs=0.0)
    assert not [s for s in _step_names(slurm) if s.startswith("conv-")]

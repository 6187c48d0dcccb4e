"""Where pairs run on a machine whose GPUs cannot give each rank its own (issue 38).

No GPU here: the device sets and pools *pretend* to have 1, 2 and 3 GPUs (slot names as
convergence.launch.pool.detect_devices writes them). What is checked is the decision at
collection (convergence.launch.placement via preflight.validate_devices) and the pool's
leases; the GPU acceptance run (benchmarks/gpu_check.sh) is the proof on a real GPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from convergence.backends import get_backend
from convergence.launch.placement import (
    GLOO_ON_CUDA,
    NotPlaceable,
    layout_collectives,
    place,
)
from convergence.launch.pool import DevicePool, DeviceSet
from convergence.preflight import load_checked, pair_jobs, validate_devices
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout
from convergence.spec.pair import PairSpec

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "experiments" / "quickstart.toml"
DP_VS_TP = REPO / "experiments" / "dp_vs_tp.toml"


def pretend_gpus(count: int, per_gpu: int = 4) -> DeviceSet:
    """What detect_devices returns on a machine with ``count`` GPUs, ``per_gpu`` slots each."""
    names = tuple(f"{g}/{k}" if k else str(g) for g in range(count) for k in range(per_gpu))
    return DeviceSet(kind="gpu", devices=names)


def pairs_of(path: Path) -> list[PairSpec]:
    return list(load_checked(path, rootdir=REPO).pairs)


def kind(pair: PairSpec) -> str:
    return pair.placement.partition(":")[0]


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_quick_start_is_all_placed_on_a_small_gpu_host(gpus: int) -> None:
    """The done-when: every quick-start pair placed (none skipped), each on one device kind,
    TP and PP off the shared GPU slots (decided here, before any job), CP sharing the GPUs."""
    placed = {
        p.name: validate_devices(p, available_devices=pretend_gpus(gpus))
        for p in pairs_of(QUICKSTART)
    }
    assert {name: kind(p) for name, p in placed.items()} == {
        "fsdp2-tp2": "cpu",
        "fsdp2-pp2": "cpu",
        "fsdp2-cp2": "cuda-shared",
    }
    for pair in placed.values():
        devices = {job.device for _, job in pair_jobs(pair)}
        assert len(devices) == 1, f"{pair.name}: control and test on {devices}"
    assert "TP" in placed["fsdp2-tp2"].placement and "functional" in placed["fsdp2-tp2"].placement
    assert "PP" in placed["fsdp2-pp2"].placement and "send_recv" in placed["fsdp2-pp2"].placement
    assert placed["fsdp2-tp2"].test.device == "cpu" == placed["fsdp2-tp2"].control.device
    assert placed["fsdp2-cp2"].test.device == "auto" == placed["fsdp2-cp2"].control.device


def test_two_rank_pairs_get_one_gpu_per_rank_from_two_gpus() -> None:
    """dp_vs_tp (2 ranks): on one GPU the TP side cannot share it, so the pair (both sides)
    goes to CPU; from two GPUs on, each rank has its own GPU (NCCL) and TP runs there."""
    where = {
        gpus: {
            p.name: kind(validate_devices(p, available_devices=pretend_gpus(gpus)))
            for p in pairs_of(DP_VS_TP)
        }
        for gpus in (1, 2, 3)
    }
    assert set(where[1].values()) == {"cpu"}
    assert set(where[2].values()) == set(where[3].values()) == {"cuda"}


def test_cuda_mode_refuses_what_cannot_share_and_says_the_fixes() -> None:
    by_name = {p.name: p for p in pairs_of(QUICKSTART)}
    with pytest.raises(NotRunnableHere) as err:
        validate_devices(
            by_name["fsdp2-pp2"], available_devices=pretend_gpus(1), device_mode="cuda"
        )
    text = f"{err.value.detail} {err.value.fix}"
    assert "needs 4 GPUs, this machine has 1" in text and "send_recv" in text
    assert "a machine with 4 GPUs" in text and "--convergence-device auto or cpu" in text
    shared = validate_devices(
        by_name["fsdp2-cp2"], available_devices=pretend_gpus(1), device_mode="cuda"
    )
    assert kind(shared) == "cuda-shared"


def test_cpu_mode_moves_every_builtin_pair_and_keys_them_apart() -> None:
    pair = pairs_of(QUICKSTART)[2]  # fsdp2-cp2: would share the GPU under auto
    on_cpu = validate_devices(pair, available_devices=pretend_gpus(1), device_mode="cpu")
    assert kind(on_cpu) == "cpu" and on_cpu.control.device == on_cpu.test.device == "cpu"
    # The device is in the run-cache identity: a GPU control is never reused for a CPU test.
    assert on_cpu.control.identity() != pair.control.identity()
    assert "device" not in pair.control.identity()  # auto: the keys of before stay


def test_cpu_machine_places_on_cpu_and_cuda_mode_says_why_not() -> None:
    cpu = DeviceSet(kind="cpu", devices=tuple(str(i) for i in range(8)))
    pair = pairs_of(QUICKSTART)[0]
    placed = validate_devices(pair, available_devices=cpu)
    assert kind(placed) == "cpu" and placed.test.device == "auto"  # nothing to hide
    with pytest.raises(NotRunnableHere, match="no GPU"):
        validate_devices(pair, available_devices=cpu, device_mode="cuda")


def test_no_sharing_allowed_sends_even_cp_to_cpu() -> None:
    """CONVERGENCE_RANKS_PER_GPU=1: one slot per GPU, so a 4-rank pair cannot share one."""
    cp = pairs_of(QUICKSTART)[2]
    placed = validate_devices(cp, available_devices=pretend_gpus(1, per_gpu=1))
    assert kind(placed) == "cpu" and "1 GPU slots" in placed.placement


FIXED = frozenset({"torchtitan"})  # its own config decides its device


def test_a_backend_that_cannot_move_is_skipped_with_real_fixes() -> None:
    assert not get_backend("torchtitan").capabilities.device_follows_placement
    job = JobSpec(
        name="titan-fsdp2",
        train_config=REPO / "train_configs" / "debug.toml",
        layout=ParallelLayout(dp_shard=2),
        backend="torchtitan",
    )
    with pytest.raises(NotPlaceable) as err:
        place([job, dataclasses.replace(job, name="other")], pretend_gpus(1), fixed=FIXED)
    assert "needs 2 GPUs, this machine has 1" in err.value.detail
    assert err.value.fix == "run on a machine with 2 GPUs"  # no CPU fallback offered
    assert place([job], pretend_gpus(2), fixed=FIXED).kind == "cuda"


def test_every_layout_need_is_in_the_measured_table() -> None:
    layouts = [
        ParallelLayout(dp_shard=2, tp=2, pp=2, cp=2),
        ParallelLayout(dp_replicate=2, dp_shard=2),
    ]
    for layout in layouts:
        assert set(layout_collectives(layout)) <= set(GLOO_ON_CUDA)


# ----------------------------------------------------------------------------------------------
# The pool: whole GPUs for jobs that fit them, shared slots for larger ones.


def test_pool_gives_whole_gpus_when_a_job_fits_and_slots_when_it_does_not(tmp_path: Path) -> None:
    pool = DevicePool(tmp_path, pretend_gpus(2).devices, "gpu", poll_s=0.01)
    with pool.lease(2) as lease:  # one GPU per rank: NCCL, no other job on those GPUs
        assert lease.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
        assert len(lease.devices) == 8
        with pytest.raises(TimeoutError):
            with pool.lease(4, timeout=0.05):
                pass
    with pool.lease(4) as shared:  # 4 ranks on 2 GPUs: spread, two per GPU
        assert shared.devices == ("0", "1", "0/1", "1/1")
        assert shared.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
        with pool.lease(3) as other:  # the remaining slots are still for sharing jobs
            assert set(other.devices) <= {"0/2", "1/2", "0/3", "1/3"}


def test_pool_on_one_gpu_runs_a_single_rank_alone(tmp_path: Path) -> None:
    pool = DevicePool(tmp_path, pretend_gpus(1).devices, "gpu", poll_s=0.01)
    with pool.lease(1) as single:
        assert single.devices == ("0", "0/1", "0/2", "0/3")
        assert single.env == {"CUDA_VISIBLE_DEVICES": "0"}


# ----------------------------------------------------------------------------------------------
# The plugin's collection on a pretended one-GPU host: the placed pairs are the items' pairs.


@pytest.fixture
def one_gpu_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    import pytest_convergence.stash as stash

    monkeypatch.setattr(stash, "session_devices", lambda launcher, cap: pretend_gpus(1))
    pytester.makeini("[pytest]\n")
    (pytester.path / "experiments").mkdir()
    (pytester.path / "experiments" / "quickstart.toml").write_text(QUICKSTART.read_text())
    return pytester


def test_collection_places_the_quick_start_on_one_gpu(one_gpu_project: pytest.Pytester) -> None:
    items, _ = one_gpu_project.inline_genitems("-m", "convergence", "experiments")
    placed = {item.name: item for item in items}
    assert set(placed) == {"fsdp2-tp2", "fsdp2-pp2", "fsdp2-cp2"}
    assert not any(item.skipped for item in items)  # type: ignore[attr-defined]
    kinds = {name: kind(item.pair) for name, item in placed.items()}  # type: ignore[attr-defined]
    assert kinds == {"fsdp2-tp2": "cpu", "fsdp2-pp2": "cpu", "fsdp2-cp2": "cuda-shared"}


def test_collection_with_device_cuda_skips_tp_and_pp_naming_why(
    one_gpu_project: pytest.Pytester,
) -> None:
    items, _ = one_gpu_project.inline_genitems(
        "-m", "convergence", "--convergence-device", "cuda", "experiments"
    )
    skipped = {
        item.name: item.get_closest_marker("skip").kwargs["reason"]  # type: ignore[union-attr]
        for item in items
        if item.skipped  # type: ignore[attr-defined]
    }
    assert set(skipped) == {"fsdp2-tp2", "fsdp2-pp2"}
    assert "gloo does not run on CUDA tensors" in skipped["fsdp2-pp2"]
    assert "--convergence-device auto or cpu" in skipped["fsdp2-tp2"]


def test_the_job_tier_runs_a_cpu_job_on_cpu_slots_with_the_gpus_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a (pretended) one-GPU machine a job placed on CPU leases the CPU slots and sees no
    GPU; a job left to the session's devices leases the GPU's slots (real processes)."""
    import convergence.run.jobs as jobs

    monkeypatch.setattr(jobs, "session_devices", lambda launcher, cap: pretend_gpus(1))
    runner = jobs.JobRunner(jobs.RunSettings(work_dir=tmp_path))
    assert runner.pool.kind == "gpu" and runner.cpu_pool is not None
    script = "import os; print('seen=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    for device, seen in (("cpu", "seen=''"), ("auto", "seen='0'")):
        request = runner.launch_request(
            device, ["-c", script], nproc=1, log_dir=tmp_path / device, direct=True
        )
        assert runner.launch(request, 2, device=device).ok
        assert seen in (tmp_path / device / "launcher.log").read_text()


@pytest.mark.parametrize(
    ("override", "axis"), [("--parallelism.tp=2", "tp"), ("--parallelism.pp=2", "pp")]
)
def test_the_trainer_refuses_tp_and_pp_on_shared_gpu_slots(override: str, axis: str) -> None:
    """The guard behind the placement, for a job launched some other way: a clean SpecError
    naming the key and the fix, never the SIGABRT/SIGSEGV of gloo on CUDA tensors."""
    from convergence.trainer.config import load_train_config
    from convergence.trainer.world import check_shared_gpu

    with pytest.raises(SpecError) as err:
        check_shared_gpu(load_train_config(REPO / "train_configs" / "debug.toml", [override]))
    assert err.value.key == f"parallelism.{axis}" and "cpu" in (err.value.fix or "")
    check_shared_gpu(
        load_train_config(REPO / "train_configs" / "debug.toml", ["--parallelism.cp=2"])
    )


# ----------------------------------------------------------------------------------------------
# Where each pair ran, in the terminal matrix, the markdown/HTML reports and JUnit.


def test_reports_show_where_each_pair_ran() -> None:
    from report_examples import failing_pair, passing_pair

    from convergence.report import build_report, junit_properties, render_markdown, render_matrix
    from convergence.report.formats.html import render_html

    def placed(outcome, text):  # type: ignore[no-untyped-def]
        return dataclasses.replace(outcome, pair=dataclasses.replace(outcome.pair, placement=text))

    on_cpu = [placed(passing_pair(), "cpu: 4 rank(s) on CPU (gloo)"), failing_pair()]
    assert "device" not in render_matrix(on_cpu)  # a CPU machine's matrix as before
    mixed = [placed(passing_pair(), "cuda-shared: 4 ranks sharing 1 GPU(s) over gloo"), on_cpu[0]]
    matrix = render_matrix(mixed)
    assert "device" in matrix.splitlines()[0]
    assert "cuda-shared" in matrix and " cpu" in matrix
    report = build_report(mixed, environment={}, started_at=None, wall_s=None, include_curves=False)
    assert report["pairs"][0]["placement"].startswith("cuda-shared: 4 ranks")
    assert "| device |" in render_markdown(report) and "cuda-shared" in render_html(report, {})
    assert (
        "convergence.device",
        "cuda-shared: 4 ranks sharing 1 GPU(s) over gloo",
    ) in junit_properties(mixed[0])

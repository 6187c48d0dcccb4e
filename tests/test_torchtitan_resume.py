"""Resume for torchtitan jobs (issue 40): the checkpoint keys of a resuming side as torchtitan's
own DCP checkpoint options and the launcher's, the layouts torchtitan 0.3 cannot resume onto,
the checkpoint check before a load, and -- trained for real on CPU (gloo) -- a correct resume
that passes and two planted resume bugs that fail at the resume step.

The layout changes themselves (FSDP2 -> FSDP2, -> FSDP2+TP2, -> FSDP2+PP2) are
experiments/torchtitan/resume.toml, collected directly in CI (``--convergence-tier ci``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from torchtitan_session import run_experiments

from experiments import experiment_doc, write_toml

if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
    pytest.importorskip(
        "torchtitan",
        reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' triton)",
    )

from convergence.backends.torchtitan.backend import TorchtitanBackend
from convergence.backends.torchtitan.launch import split_argv
from convergence.backends.torchtitan.resume import MANIFEST, check_checkpoint
from convergence.preflight import check_pair
from convergence.regimes import REGISTRY
from convergence.run.resume import phase_jobs
from convergence.spec.errors import SpecError
from convergence.spec.experiment import load_experiment

# One worker runs this module's training session (tests/conftest.py: run sharing).
pytestmark = pytest.mark.xdist_group("torchtitan_resume")

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "experiments" / "torchtitan" / "resume.toml"
DEFAULTS = {
    "backend": "torchtitan",
    "backend_options": {"module": "llama3", "config": "llama3_debugmodel"},
    "steps": 4,
    "seed": 42,
    "local_batch_size": 2,
    "overrides": {
        "training.seq_len": 64,
        "lr_scheduler.warmup_steps": 2,
        "validator.enable": False,
    },
}


def shipped_test(name: str):  # type: ignore[no-untyped-def]
    pairs = load_experiment(SHIPPED, rootdir=REPO, regimes=REGISTRY).pairs
    return next(p for p in pairs if p.test.name == name)


# -- the two jobs' command lines (torchtitan's parser, no training) ------------------------------


def test_the_checkpoint_keys_become_torchtitans_options(tmp_path: Path) -> None:
    pair = shipped_test("fsdp2-resume-fsdp2-tp2")
    check_pair(pair)  # collection accepts a torchtitan resume now
    backend = TorchtitanBackend()
    ckpt = tmp_path / "ckpt"
    before, after = phase_jobs(pair.test, ckpt)
    first = backend.train_entry(before, tmp_path / "d1", tmp_path / "seed")
    second = backend.train_entry(after, tmp_path / "d2", tmp_path / "seed")
    assert "--convergence.stop_after=2" in first and f"--checkpoint.folder={ckpt}" in first
    assert f"--convergence.resume_from={ckpt}" in second
    # ... which the launcher takes off torchtitan's command line.
    assert split_argv(first[2:])[0].stop_after == 2
    assert split_argv(second[2:])[0].resume_from == str(ckpt)
    # The built-in trainer's keys never reach torchtitan (its parser would refuse them).
    assert not any("save_at_step" in w or "checkpoint.resume_from" in w for w in first + second)
    # torchtitan's own parser reads them: job 1 saves at step 2 into the folder (the seed
    # checkpoint's load-only word overridden), job 2 loads from it and never saves.
    saving = backend.effective_config(before).checkpoint
    loading = backend.effective_config(after).checkpoint
    assert (saving.enable, saving.folder, saving.interval, saving.load_only) == (
        True,
        str(ckpt),
        2,
        False,
    )
    assert (loading.enable, loading.folder, loading.load_only) == (True, str(ckpt), True)
    assert backend.effective_config(after).parallelism.tensor_parallel_degree == 2
    # The seed checkpoint of a phase job is the control's: no checkpoint words in it.
    seed = backend.seed_entry(before, tmp_path / "seed")
    assert not any("interval" in w or "resume_from" in w for w in seed)


def test_another_dp_degree_at_the_resume_is_a_collection_error(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path / "experiments" / "hsdp.toml",
        experiment_doc(
            experiment={"description": "HSDP -> FSDP2+PP2"},
            defaults={**DEFAULTS, "train_config": "hsdp.toml"},
            control={"name": "fsdp4", "parallelism": {"dp_shard": 4}},
            tests=[
                {
                    "name": "hsdp",
                    "parallelism": {"dp_replicate": 2, "dp_shard": 2},
                    "resume": {"at_step": 2, "parallelism": {"dp_shard": 2, "pp": 2}},
                }
            ],
        ),
    )
    pair = load_experiment(path, rootdir=tmp_path, regimes=REGISTRY).pairs[0]
    with pytest.raises(SpecError) as info:
        check_pair(pair, key="test[0]")
    assert info.value.key == "test[0].resume.parallelism"
    assert "dataloader resharding is not supported yet" in str(info.value)
    assert "dp_replicate x dp_shard = 4" in str(info.value)


# -- the checkpoint check before torchtitan loads -------------------------------------------------


def test_a_missing_or_foreign_checkpoint_is_an_error_naming_it(tmp_path: Path) -> None:
    wanted = {"format": 1, "step": 0, "model": {"model.dim": 256}, "training": {"steps": 4}}
    folder = tmp_path / "ckpt"
    with pytest.raises(SystemExit, match=f"checkpoint {folder} cannot serve this resume: the"):
        check_checkpoint(str(folder), wanted)
    (folder / "step-2").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no step-N folder with DCP's .metadata"):
        check_checkpoint(str(folder), wanted)
    (folder / "step-2" / ".metadata").write_bytes(b"")
    with pytest.raises(SystemExit, match=f"{MANIFEST} is missing"):
        check_checkpoint(str(folder), wanted)
    saved = {**wanted, "step": 2, "model": {"model.dim": 512}}
    (folder / MANIFEST).write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="model.model.dim: checkpoint 512, this job 256"):
        check_checkpoint(str(folder), wanted)
    (folder / MANIFEST).write_text(json.dumps({**wanted, "step": 2}))
    check_checkpoint(str(folder), wanted)  # this run's: no error


# -- trained: a correct resume passes, two planted resume bugs fail at the resume ------------------


def test_planted_resume_bugs_fail_at_the_resume_step(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """One rank each, 4 steps, checkpoint after step 2: the correct resume is bitwise the
    control; the dropped optimizer state and the restarted LR schedule both show at step 4 (K+2:
    step 3's update is the first wrong one)."""
    resume = {"at_step": 2}
    one_rank = {"dp_shard": 1}
    doc = experiment_doc(
        experiment={"description": "torchtitan resume: a correct one and two planted bugs"},
        defaults={**DEFAULTS, "train_config": "tt_resume.toml", "early_stop": False},
        control={"name": "fsdp1", "parallelism": one_rank},
        tests=[
            {"name": "resumed", "parallelism": one_rank, "resume": resume},
            *(
                {
                    "name": bug,
                    "parallelism": one_rank,
                    "resume": resume,
                    "hook": f"planted_resume_bugs:{bug}",
                }
                for bug in ("optimizer_state_dropped", "scheduler_restarted")
            ),
        ],
    )
    result, lines, work = run_experiments(
        pytester, monkeypatch, request, {"tt_resume.toml": doc}, timeout=900
    )
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=2)
    assert re.search(r"\bresumed\s.*PASS", out), out
    # Each failure is placed at the resume, the resume named.
    assert out.count("the divergence starts at the resume") >= 2, out
    assert "resume: checkpoint after step 2, single -> single" in out, out
    # Both show at K+2 = 4: step 3's update is the first wrong one.
    failing = re.findall(r"(loss|grad_norm)\s+paired\s+FAIL\s+first divergent step (\d+)", out)
    assert failing and {step for _, step in failing} == {"4"}, out
    # torchtitan's own lines: job 2 loads job 1's checkpoint and starts at step 3.
    assert any(": step:  3 " in line or "step:  3" in line for line in lines), lines
    logs = "\n".join(
        p.read_text(errors="replace") for p in (work / "runs").rglob("*resumed*/logs/**/std*.log")
    )
    assert "Training starts at step 3" in logs and "step-2" in logs

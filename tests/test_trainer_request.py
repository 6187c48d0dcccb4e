"""The typed trainer request (convergence/spec/trainer_request.py) and the run folder's names
(convergence/spec/run_dir.py): what a job asks of its trainer, keyed as the overrides it
travelled as before it had a type, and said in each backend's own words."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from convergence.backends.builtin import BuiltinBackend
from convergence.configs import shipped_config
from convergence.spec.job import JobSpec
from convergence.spec.run_dir import RunDir, anchor_of
from convergence.spec.trainer_request import TrainerRequest

JOB = JobSpec(name="c", train_config=shipped_config("debug"), overrides=(("training.lr", "0.01"),))


def test_an_empty_request_leaves_the_identity_as_it_was() -> None:
    identity = JOB.identity()
    assert identity["overrides"] == [["training.lr", "0.01"]] and "probe_step" not in identity
    assert JOB.request.empty and not JOB.asking(anchor_every=5).request.empty


@pytest.mark.parametrize(
    ("parts", "words"),
    [
        ({"anchor_every": 10}, [("checkpoint.anchor_every", "10")]),
        (
            {"anchored_from": Path("/a/anchors")},
            [
                ("checkpoint.anchored_from", "/a/anchors"),
                ("metrics.log_freq", "1"),
                ("metrics.val_every", "0"),
            ],
        ),
        (
            {"save_at": 5, "save_folder": Path("/ck")},
            [("checkpoint.save_at_step", "5"), ("checkpoint.save_folder", "/ck")],
        ),
        ({"resume_from": Path("/ck")}, [("checkpoint.resume_from", "/ck")]),
        ({"probe_step": 3}, []),  # never an override: a probe's key is its own
    ],
)
def test_a_request_is_keyed_and_said_as_its_old_overrides(
    parts: dict[str, object], words: list[tuple[str, str]]
) -> None:
    job = JOB.asking(**parts)
    assert job.identity()["overrides"] == [["training.lr", "0.01"], *map(list, words)]
    entry = BuiltinBackend().train_entry(job, Path("/d"), None)
    flags = [f"--{k}={v}" for k, v in words]
    user = entry.index("--training.lr=0.01")
    assert entry[user + 1 : user + 1 + len(flags)] == flags  # after the user's, as before


def test_the_probe_is_the_built_in_trainers_probe_flags_at_the_end() -> None:
    entry = BuiltinBackend().train_entry(JOB.asking(probe_step=3), Path("/d"), Path("/s"))
    assert entry[-3:] == [
        "--probe.enable=true",
        "--probe.step=3",
        "--metrics.enable_tensorboard=false",
    ]
    assert JOB.asking(probe_step=3).identity()["probe_step"] == 3


@pytest.mark.parametrize(
    "parts",
    [
        {"save_at": 5},
        {"save_folder": Path("/ck")},
        {"anchor_every": 5, "anchored_from": Path("/a")},
        {"probe_step": -1},
    ],
)
def test_a_request_that_asks_the_impossible_is_refused(parts: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="TrainerRequest"):
        TrainerRequest(**parts)  # type: ignore[arg-type]


def test_the_run_folder_names_its_files_for_both_sides(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "control-x")
    dump = run.dump
    assert dump.path == tmp_path / "control-x" / "dump"
    assert (dump.metrics.name, dump.run_meta.name, dump.stop.name) == (
        "metrics.jsonl",
        "run_meta.json",
        "STOP",
    )
    assert dump.anchor(20) == dump.path / "anchors" / "step20"
    assert anchor_of(dump.anchor(20)) == (dump.anchors, 20)
    assert anchor_of(tmp_path / "ckpt") is None and anchor_of(dump.anchors / "stepx") is None


def test_torchtitan_saves_the_anchors_where_the_anchored_check_reads_them(tmp_path: Path) -> None:
    if not os.environ.get("CI"):  # in CI (.ci/run installs it) a missing torchtitan must fail
        pytest.importorskip(
            "torchtitan",
            reason="torchtitan is not installed (pip install 'pytest-convergence[torchtitan]' "
            "triton)",
        )
    from convergence.backends.torchtitan.anchors import torchtitan_words

    dump = RunDir(tmp_path / "control-x").dump
    words = torchtitan_words(TrainerRequest(anchor_every=5), dump.path)
    assert f"--checkpoint.folder={dump.anchors}" in words

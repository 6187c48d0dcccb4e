"""The anchored check for torchtitan jobs (pair key ``anchor_every``, issue 41), trained for real
on CPU (gloo): the control saves torchtitan's own DCP checkpoint every 4 steps, each test layout
trains one step from each (convergence/backends/torchtitan/anchors.py), and the judge compares
them with the control's own next step (convergence/stats/anchored.py).

One session, 12 steps, anchors at steps 4 and 8: a correct TP2 layout passes; a bug that starts
at step 9 (tests/fixtures/hooks/planted_titan_late_bugs.py) fails the ``anchored`` verdict at
anchor 8, whose one step is the bug's first, and the numerics probe starts from that anchor
(both layouts load torchtitan's step-8) and names the buggy parameter. Plus, without training:
the command lines, and the DP-degree change torchtitan cannot load, refused at collection.
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

from convergence.backends.torchtitan.anchors import MANIFEST
from convergence.backends.torchtitan.backend import TorchtitanBackend
from convergence.backends.torchtitan.launch import split_argv
from convergence.checks import pair_keys
from convergence.checks.anchored import AnchoredCheck, anchored_job
from convergence.metrics.curve import Curve, RunMetrics
from convergence.metrics.jsonl import read_jsonl
from convergence.metrics.tensorboard import read_tensorboard
from convergence.preflight import check_pair
from convergence.regimes import REGISTRY
from convergence.spec.errors import SpecError
from convergence.spec.experiment import load_experiment
from convergence.spec.run_dir import RunDir

pytestmark = pytest.mark.xdist_group("torchtitan_anchors")

STEPS, EVERY, FIRST_BAD_STEP = 12, 4, 9
DEFAULTS = {
    "backend": "torchtitan",
    "backend_options": {"module": "llama3", "config": "llama3_debugmodel"},
    "steps": STEPS,
    "seed": 42,
    "local_batch_size": 2,
    "regime": "paired",
    "early_stop": False,
    "anchor_every": EVERY,
    "overrides": {
        "training.seq_len": 64,
        "lr_scheduler.warmup_steps": 2,
        "validator.enable": False,
    },
}
SINGLE = {"dp_shard": 1}


def experiment(tests: list[dict[str, object]], **defaults: object) -> dict[str, object]:
    return experiment_doc(
        experiment={"description": "torchtitan: the anchored check"},
        defaults={**DEFAULTS, "train_config": "tt_anchors.toml", **defaults},
        control={"name": "single", "parallelism": SINGLE},
        tests=tests,
    )


# -- the command lines (torchtitan's parser, no training) ----------------------------------------


def test_the_anchor_keys_become_torchtitans_options(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path / "experiments" / "tt_anchors.toml",
        experiment([{"name": "tp2", "parallelism": {**SINGLE, "tp": 2}}]),
    )
    loaded = load_experiment(path, rootdir=tmp_path, regimes=REGISTRY, checks_keys=pair_keys())
    pair = loaded.pairs[0]
    check_pair(pair)  # collection accepts a torchtitan pair with anchor_every
    backend = TorchtitanBackend()
    control = AnchoredCheck().control_jobs(pair, [pair.control])[0]
    folder = tmp_path / "c" / "anchors"
    test = anchored_job(pair.test, folder)
    saving = backend.train_entry(control, tmp_path / "c", tmp_path / "seed")
    loading = backend.train_entry(test, tmp_path / "t", tmp_path / "seed")
    assert split_argv(saving[2:])[0].anchor_every == EVERY
    assert split_argv(loading[2:])[0].anchored_from == str(folder)
    # The built-in trainer's words never reach torchtitan's parser (it would refuse them).
    builtin_words = ("anchor_every", "anchored_from", "val_every")
    for argv in (saving, loading):
        assert not any(k in w for w in split_argv(argv[2:])[1] for k in builtin_words)
    ckpt = backend.effective_config(control).checkpoint
    assert (ckpt.enable, ckpt.interval, ckpt.load_only, ckpt.keep_latest_k) == (
        True,
        EVERY,
        False,
        0,
    )
    ckpt = backend.effective_config(test).checkpoint
    assert (ckpt.enable, ckpt.folder, ckpt.load_only) == (True, str(folder), True)
    # The probe from anchor 8 (checks/anchored.py names it <anchors>/step8, the built-in
    # trainer's folder): torchtitan loads its step-8 from the anchors folder.
    probe = pair.test.asking(resume_from=folder / "step8")
    ckpt = backend.effective_config(probe).checkpoint
    assert (ckpt.folder, ckpt.load_step, ckpt.load_only) == (str(folder), 8, True)
    seed = backend.seed_entry(control, tmp_path / "seed")  # the seed checkpoint: no anchors
    assert not any("anchor_every" in w or "interval" in w for w in seed)


def test_confirming_anchors_save_every_anchors_next_step_too(tmp_path: Path) -> None:
    """The twin regime's control (checks/anchored.py): torchtitan offers a save after every
    step (interval 1) and the launcher keeps the anchors and their next steps."""
    from convergence.spec.trainer_request import saves_anchor_after

    path = write_toml(
        tmp_path / "experiments" / "tt_anchors.toml",
        experiment([{"name": "tp2", "parallelism": {**SINGLE, "tp": 2}}]),
    )
    loaded = load_experiment(path, rootdir=tmp_path, regimes=REGISTRY, checks_keys=pair_keys())
    control = loaded.pairs[0].control.asking(anchor_every=EVERY, confirming_anchors=True)
    backend = TorchtitanBackend()
    options = split_argv(backend.train_entry(control, tmp_path / "c", tmp_path / "seed")[2:])[0]
    assert (options.anchor_every, options.confirming_anchors) == (EVERY, True)
    assert backend.effective_config(control).checkpoint.interval == 1

    def saved(confirming: bool) -> list[int]:
        return [
            s
            for s in range(1, STEPS)
            if saves_anchor_after(s, every=EVERY, confirming=confirming, steps=STEPS)
        ]

    assert saved(True) == [4, 5, 8, 9]
    assert saved(False) == [4, 8]


def test_another_dp_degree_is_a_collection_error(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path / "experiments" / "tt_anchors.toml",
        experiment([{"name": "fsdp2", "parallelism": {"dp_shard": 2}}]),
    )
    loaded = load_experiment(path, rootdir=tmp_path, regimes=REGISTRY, checks_keys=pair_keys())
    pair = loaded.pairs[0]
    with pytest.raises(SpecError) as info:
        check_pair(pair, key="test[0]")
    assert info.value.key == "test[0].anchor_every"
    assert "dataloader keeps one position per DP rank" in str(info.value)
    assert "dp_replicate x dp_shard = 1" in str(info.value)


def metrics(run: Path) -> RunMetrics:
    """A job's curves from its run folder (torchtitan's TensorBoard and the wrapper's records)."""
    dump = RunDir(run).dump
    out = read_tensorboard(dump.tensorboard)
    out.update(read_jsonl(dump.step_log))
    return out


def at(curve: Curve, step: int) -> float:
    return float(curve.values[list(curve.steps).index(step)])


# -- trained: a correct layout passes, a late bug fails at its anchor and is probed there ---------


def test_a_late_bug_fails_at_its_anchor_and_is_probed_there(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    doc = experiment(
        [
            {"name": "tp2", "parallelism": {**SINGLE, "tp": 2}},
            {
                "name": "late-bug",
                "parallelism": SINGLE,
                "hook": "planted_titan_late_bugs:double_ffn_grad_from_step9",
            },
        ]
    )
    result, lines, work = run_experiments(
        pytester, monkeypatch, request, {"tt_anchors.toml": doc}, timeout=900
    )
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    outcomes = {
        o["pair"]["test"]["name"]: o
        for o in (json.loads(p.read_text()) for p in work.glob("sessions/*/*.outcome.json"))
    }
    verdicts = {
        name: next(v for v in o["verdicts"] if v["metric"] == "anchored")
        for name, o in outcomes.items()
    }
    correct, buggy = verdicts["tp2"], verdicts["late-bug"]
    assert correct["passed"] and correct["details"]["anchors"] == [4, 8], correct
    assert not buggy["passed"], buggy
    assert buggy["details"]["anchor_step"] == 8, buggy  # its step 9 is the bug's first
    assert buggy["details"]["anchors_failing"] == [8], buggy  # anchor 4 is still right
    assert "from the control's state at step 8" in out, out
    # The probe started from that anchor (no replay of the run up to it) and names the bug.
    probe = outcomes["late-bug"]["localisation"]
    assert "error" not in probe and probe["anchor_step"] == 8, probe
    assert probe["parameter"] == "layers.0.feed_forward.w2.weight", probe
    # torchtitan's own lines: the anchored jobs train steps 5 and 9 only.
    anchored = [line for line in lines if "-anchored" in line.split(":")[0]]
    assert anchored and {re.search(r"step:\s+(\d+)", x)[1] for x in anchored} == {"5", "9"}  # type: ignore[index]
    # Saving anchors leaves the control's curve as it is: bitwise the same layout's without
    # them (the late bug's side) up to the bug, past anchors 4 and 8; and the anchored step 5 of that
    # layout is bitwise the control's own, on the control's batch (the data position loads).
    runs = work / "runs"
    control = metrics(next(runs.glob("*/control-*")))  # run once, by the first pair
    # The uninterrupted test run: not the anchored job (a job hash may start with "a" too).
    plain = metrics(
        next(p for p in runs.glob("*late-bug/test-late-bug-*") if "-anchored-" not in p.name)
    )
    steps = range(1, FIRST_BAD_STEP)
    for name in ("loss", "grad_norm"):
        assert [at(control[name], s) for s in steps] == [at(plain[name], s) for s in steps], name
    one_step = metrics(next(runs.glob("*late-bug/test-late-bug-anchored-*")))
    for name in ("loss", "grad_norm", "data_fingerprint"):
        assert at(one_step[name], 5) == at(control[name], 5), name
    assert at(one_step["data_fingerprint"], 9) == at(control["data_fingerprint"], 9)
    # The control kept its anchors (never the last step) with the manifest listing them.
    manifests = list((work / "runs").rglob(f"anchors/{MANIFEST}"))
    assert manifests and json.loads(manifests[0].read_text())["anchors"] == [4, 8]
    assert sorted(p.name for p in manifests[0].parent.glob("step-*")) == ["step-4", "step-8"]


def test_twin_pairs_confirm_from_each_anchors_next_state(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The twin regime: the control saves anchor 4 and its next state 5 through torchtitan's
    own DCP checkpointer, and the anchored jobs (the test's and the twin's) train one step from
    each in torchtitan's own loop -- steps 5 and 6 -- which the verdict judges (5) and confirms
    with (6)."""
    doc = experiment(
        [{"name": "tp2", "parallelism": {**SINGLE, "tp": 2}}],
        regime="twin",
        steps=8,
    )
    result, lines, work = run_experiments(
        pytester, monkeypatch, request, {"tt_anchors.toml": doc}, timeout=900
    )
    result.assert_outcomes(passed=1)
    (outcome,) = (json.loads(p.read_text()) for p in work.glob("sessions/*/*.outcome.json"))
    anchored = next(v for v in outcome["verdicts"] if v["metric"] == "anchored")
    assert anchored["passed"] and anchored["details"]["anchors"] == [4], anchored
    assert anchored["details"]["confirming_steps"] == 1, anchored
    manifests = list((work / "runs").rglob(f"anchors/{MANIFEST}"))
    assert manifests and json.loads(manifests[0].read_text())["anchors"] == [4, 5]
    # torchtitan's own step lines: each anchored job (test and twin) trained steps 5 and 6.
    jobs: dict[str, set[str]] = {}
    for line in lines:
        job = line.split(":")[0]
        if "-anchored" in job and (step := re.search(r"step:\s+(\d+)", line)):
            jobs.setdefault("twin" if "twin" in job else "test", set()).add(step[1])
    assert jobs == {"test": {"5", "6"}, "twin": {"5", "6"}}, lines

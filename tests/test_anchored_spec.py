"""The pair key ``anchor_every`` (the anchored check, issue 41): owned by its check
(convergence/checks/anchored.py), kept on the pair as written, parsed by the check at
collection; bad values a collection error naming the file, the key and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from convergence.checks.anchored import (
    AUTO_EVERY,
    AUTO_MAX_ANCHORS,
    AUTO_MIN_STEPS,
    anchor_spacing,
    auto_anchor_every,
)
from convergence.preflight import load_checked
from convergence.regimes import REGISTRY
from convergence.spec.errors import SpecError
from convergence.spec.experiment import load_experiment


def _experiment(tmp_path: Path, test_extra: str = "", defaults_extra: str = "") -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(
        f"""
[defaults]
train_config = "debug"
steps = 40
{defaults_extra}

[control]
parallelism = {{ dp_shard = 2 }}

[[test]]
name = "tp"
parallelism = {{ dp_shard = 2, tp = 2 }}
{test_extra}
"""
    )
    return path


def _pair(path: Path):  # type: ignore[no-untyped-def]
    (pair,) = load_checked(path, rootdir=path.parent).pairs
    return pair


def test_automatic_unless_set_and_read_from_defaults_or_the_test(tmp_path: Path) -> None:
    absent = _pair(_experiment(tmp_path))
    assert absent.check_key("anchor_every") is None  # chosen when the pair runs
    off = _pair(_experiment(tmp_path, defaults_extra="anchor_every = 0"))
    assert off.check_keys == (("anchor_every", 0),) and anchor_spacing(off) == 0
    assert _pair(_experiment(tmp_path, defaults_extra="anchor_every = 10")).check_keys == (
        ("anchor_every", 10),
    )
    both = _experiment(tmp_path, "anchor_every = 5", defaults_extra="anchor_every = 10")
    assert anchor_spacing(_pair(both)) == 5


def test_the_spec_alone_does_not_know_the_key(tmp_path: Path) -> None:
    """spec/ parses only the keys it is told of: the check's key is the checks' (the
    registry's pair_keys(), which load_checked passes)."""
    path = _experiment(tmp_path, "anchor_every = 10")
    with pytest.raises(SpecError, match="anchor_every"):
        load_experiment(path, rootdir=tmp_path, regimes=REGISTRY)
    (pair,) = load_experiment(
        path, rootdir=tmp_path, regimes=REGISTRY, checks_keys=("anchor_every",)
    ).pairs
    assert pair.check_key("anchor_every") == 10


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("-3", "positive integer"),
        ("true", "positive integer"),
        ('"10"', "positive integer"),
        ("2.5", "positive integer"),
        ("40", "leaves no anchor inside the run of 40 steps"),
    ],
)
def test_a_bad_value_names_the_file_the_key_and_the_fix(
    tmp_path: Path, value: str, problem: str
) -> None:
    with pytest.raises(SpecError) as info:
        _pair(_experiment(tmp_path, f"anchor_every = {value}"))
    text = str(info.value)
    assert "exp.toml" in text and "anchor_every" in text and problem in text, text
    assert info.value.fix and "anchor_every" in info.value.fix, text


def test_a_resuming_test_cannot_be_anchored(tmp_path: Path) -> None:
    path = _experiment(tmp_path, "anchor_every = 10\nresume = { at_step = 20 }")
    with pytest.raises(SpecError, match="anchor_every and resume"):
        _pair(path)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["--checkpoint.anchor_every=-1"], "checkpoint.anchor_every"),
        (["--checkpoint.anchor_every=5", "--probe.enable=true"], "probe.enable"),
        (
            ["--checkpoint.anchored_from=/a", "--checkpoint.resume_from=/b"],
            "checkpoint.anchored_from",
        ),
        (["--checkpoint.anchored_steps=0"], "checkpoint.anchored_steps"),
        (["--checkpoint.confirming_anchors=true"], "checkpoint.confirming_anchors"),
        (
            ["--checkpoint.anchor_every=1", "--checkpoint.confirming_anchors=true"],
            "checkpoint.confirming_anchors",
        ),
    ],
)
def test_the_trainer_refuses_anchor_keys_it_cannot_honour(overrides: list[str], key: str) -> None:
    from convergence.trainer.config import load_train_config
    from convergence.trainer.config_checks import check_config

    cfg = load_train_config("debug", overrides)
    with pytest.raises(SpecError) as info:
        check_config(cfg, 1)
    assert key in str(info.value), str(info.value)


def test_a_probe_may_start_from_a_resume_checkpoint() -> None:
    """The probe at a failing anchor: resume_from + probe (convergence/checks/anchored.py AnchoredCheck.probe)."""
    from convergence.trainer.config import load_train_config
    from convergence.trainer.config_checks import check_config

    cfg = load_train_config(
        "debug", ["--checkpoint.resume_from=/a", "--probe.enable=true", "--probe.step=31"]
    )
    check_config(cfg, 1)


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("command", 'backend_options = { command = ["python", "train.py", "{dump_dir}"] }'),
        # (torchtitan has them: tests/test_torchtitan_anchors.py)
    ],
)
def test_a_backend_without_anchored_steps_cannot_be_anchored(
    tmp_path: Path, backend: str, options: str
) -> None:

    path = tmp_path / "exp.toml"
    (tmp_path / "train.toml").write_text("")
    path.write_text(
        f"""
[defaults]
train_config = "train.toml"
backend = "{backend}"
{options}
steps = 40
anchor_every = 10

[control]
name = "a"

[[test]]
name = "b"
"""
    )
    with pytest.raises(SpecError) as info:
        load_checked(path, rootdir=tmp_path)
    assert "anchor_every" in str(info.value) and f"'{backend}'" in str(info.value), info.value


def test_an_anchored_job_trains_m_steps_from_each_anchor_never_past_the_next() -> None:
    """checkpoint.anchored_steps = m (benchmarks/detection/anchored_redraw.py measures it):
    K+1..K+m from each anchor K, cut at the next anchor and at the run's last step."""
    from convergence.trainer.anchors import anchored_steps

    assert anchored_steps([10, 20, 30], 1, 40) == [11, 21, 31]
    assert anchored_steps([10, 20, 30], 3, 40) == [11, 12, 13, 21, 22, 23, 31, 32, 33]
    assert anchored_steps([10, 20, 30], 15, 34) == [*range(11, 21), *range(21, 31), *range(31, 35)]


def test_a_backend_without_anchors_is_refused_naming_those_with_them(tmp_path: Path) -> None:
    """Issue 52: the refusal said "run it on the built-in trainer" although torchtitan has
    anchors too (through its DCP checkpoints)."""
    from convergence.preflight import make_checked_pair

    (tmp_path / "t.toml").write_text("")
    side = {
        "train_config": "t.toml",
        "backend": "command",
        "backend_options": {"command": ["train.py", "{dump_dir}"]},
        "parallelism": {"dp_shard": 2},
        "steps": 40,
    }
    with pytest.raises(SpecError) as caught:
        make_checked_pair(
            name="cmd",
            control=side,
            test={**side, "anchor_every": 10},
            rootdir=tmp_path,
            source=str(tmp_path / "e.toml"),
        )
    text = str(caught.value)
    assert "anchor_every" in text and "torchtitan" in text and "built-in" in text, text


def test_the_automatic_spacing_follows_the_rule() -> None:
    """No anchors below AUTO_MIN_STEPS; from there one every AUTO_EVERY steps (a bug from
    step S meets an anchor within AUTO_EVERY steps), at most AUTO_MAX_ANCHORS per run."""
    assert auto_anchor_every(AUTO_MIN_STEPS - 1) == 0
    assert auto_anchor_every(AUTO_MIN_STEPS) == AUTO_EVERY
    assert auto_anchor_every(500) == AUTO_EVERY
    for steps in (100, 500, 1000, 5000, 100_000):
        every = auto_anchor_every(steps)
        assert AUTO_EVERY <= every < steps
        assert (steps - 1) // every <= AUTO_MAX_ANCHORS


def test_the_automatic_check_is_only_where_it_can_run(tmp_path: Path) -> None:
    long = _experiment(tmp_path, defaults_extra="").read_text().replace("steps = 40", "steps = 120")
    path = tmp_path / "long.toml"
    path.write_text(long)
    pair = _pair(path)
    assert anchor_spacing(pair) == AUTO_EVERY  # built-in trainer, 120 steps
    assert anchor_spacing(_pair(_experiment(tmp_path))) == 0  # 40 steps
    off = tmp_path / "off.toml"
    off.write_text(long.replace("steps = 120", "steps = 120\nanchor_every = 0"))
    assert anchor_spacing(_pair(off)) == 0
    # A command trainer has no anchors: no automatic check, and no error either.
    command = dataclasses.replace(pair, test=dataclasses.replace(pair.test, backend="command"))
    assert anchor_spacing(command) == 0


def test_twin_pairs_controls_save_confirming_anchors_paired_ones_do_not(tmp_path: Path) -> None:
    """checks/anchored.py: where twins size the one-step tolerance (bf16: the twin regime) the
    control also saves each anchor's next state (stats/anchored.py CONFIRMING_STEP); a paired
    pair's control, and its cache key, are what they were; the twins save nothing."""
    from convergence.backends.registry import get_backend
    from convergence.checks.anchored import AnchoredCheck
    from convergence.regimes import get_regime

    for precision, extra, confirming in (
        ("fp32", "", False),
        ("bf16", 'techniques = { param_dtype = "bfloat16" }', True),
    ):
        folder = tmp_path / precision
        folder.mkdir()
        pair = _pair(_experiment(folder, defaults_extra=f"anchor_every = 10\n{extra}"))
        jobs = get_regime(pair.regime).control_jobs(pair, get_backend(pair.control.backend))
        out = AnchoredCheck().control_jobs(pair, jobs)
        assert out[0].request.anchor_every == 10
        assert out[0].request.confirming_anchors is confirming, precision
        assert all(job.request.empty for job in out[1:]), precision
        assert (len(out) > 1) is confirming  # the twins


def test_confirming_anchors_travel_as_one_override_and_need_anchor_every(tmp_path: Path) -> None:
    """The built-in trainer's ``checkpoint.confirming_anchors``: absent from a plain control's
    overrides (its cache key unchanged), one override where asked; the trainer saves the
    anchors' next steps too, never the last step."""
    from convergence.spec.trainer_request import TrainerRequest
    from convergence.trainer.anchors import saves_anchor
    from convergence.trainer.config import load_train_config

    plain = TrainerRequest(anchor_every=10).as_overrides()
    assert plain == (("checkpoint.anchor_every", "10"),)
    asked = TrainerRequest(anchor_every=10, confirming_anchors=True).as_overrides()
    assert asked == (*plain, ("checkpoint.confirming_anchors", "true"))
    with pytest.raises(ValueError, match="confirming_anchors goes with anchor_every"):
        TrainerRequest(confirming_anchors=True)
    cfg = load_train_config(
        "debug",
        [
            "--training.steps=31",
            "--checkpoint.anchor_every=10",
            "--checkpoint.confirming_anchors=true",
        ],
    )
    assert [s for s in range(1, 32) if saves_anchor(cfg, s)] == [10, 11, 20, 21, 30]
    cfg = load_train_config("debug", ["--training.steps=31", "--checkpoint.anchor_every=10"])
    assert [s for s in range(1, 32) if saves_anchor(cfg, s)] == [10, 20, 30]

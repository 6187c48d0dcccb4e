"""Experiment TOML -> PairSpecs: defaults, sweeps, and errors that name file, key and fix."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from convergence.preflight import load_checked, validate_devices
from convergence.regimes import REGISTRY
from convergence.spec.errors import SpecError
from convergence.spec.experiment import load_experiment
from convergence.spec.layout import ParallelLayout
from convergence.spec.pp_schedules import MULTI_STAGE_SCHEDULES, SCHEDULES
from experiments import DEBUG_CONFIG, experiment_doc, write_toml

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    return write_toml(tmp_path / "exp.toml", doc)


def good() -> dict[str, Any]:
    """A valid experiment (a control, a test and a two-schedule sweep); each test changes a
    fresh copy."""
    return copy.deepcopy(_GOOD)


_GOOD = experiment_doc(
    defaults={"train_config": DEBUG_CONFIG, "steps": 12, "seed": 7},
    control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
    tests=[
        {
            "name": "fsdp2-tp2",
            "parallelism": {"dp_shard": 2, "tp": 2},
            "compare": {"loss": "paired", "grad_norm": {"method": "allclose", "rtol": 1e-3}},
        }
    ],
    sweeps=[
        {
            "name": "fsdp2-pp{pp}-{pp_schedule}",
            "parallelism": {"dp_shard": 2},
            "grid": {"pp": [2], "pp_schedule": ["1F1B", "Interleaved1F1B"]},
        }
    ],
)


def test_pairs_from_tests_and_sweeps(tmp_path: Path) -> None:
    exp = load_checked(write(tmp_path, good()), rootdir=ROOT)
    names = [p.name for p in exp.pairs]
    assert names == ["fsdp2-tp2", "fsdp2-pp2-1F1B", "fsdp2-pp2-Interleaved1F1B"]
    pair = exp.pairs[0]
    assert pair.pair_id == "exp.toml::fsdp2-tp2"
    assert pair.control.layout.dp_shard == 2 and pair.test.layout.tp == 2
    assert pair.test.steps == 12 and pair.test.seed == 7
    assert pair.regime == "paired"
    assert pair.rule_for("loss").method == "paired"
    grad = pair.rule_for("grad_norm")
    assert grad.method == "allclose" and grad.rtol == 1e-3
    assert exp.pairs[2].test.layout.pp_schedule == "Interleaved1F1B"


def error_for(tmp_path: Path, doc: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_checked(write(tmp_path, doc), rootdir=ROOT)
    return info.value


def test_parsing_is_spec_and_the_backend_checks_are_preflight(tmp_path: Path) -> None:
    """spec/ parses (no backend involved); convergence.preflight adds the checks that need a
    backend, with the pair's place in the file in its errors."""
    doc = good()
    doc["test"][0]["parallelism"] = {"tp": 2}
    path = write(tmp_path, doc)
    experiment = load_experiment(path, rootdir=ROOT, regimes=REGISTRY)
    assert experiment.keys[0] == "test[0]" and len(experiment.keys) == len(experiment.pairs)
    with pytest.raises(SpecError) as info:
        load_checked(path, rootdir=ROOT)
    assert "tokens per optimizer step differ" in str(info.value)
    assert info.value.key == "test[0].local_batch_size"


def test_spec_is_the_bottom_layer() -> None:
    """Importing the spec (parsing included) loads no other package of the library."""
    import subprocess
    import sys

    code = (
        "import sys, convergence.spec.experiment, convergence.spec.rules; "
        "print(sorted(m for m in sys.modules if m.startswith('convergence.')))"
    )
    loaded = eval(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert [
        m for m in loaded if not m.startswith(("convergence.spec", "convergence.configs"))
    ] == []


def test_unknown_key_is_named(tmp_path: Path) -> None:
    doc = good()
    doc["test"][0]["parallelism"] = {"dp_shard": 2, "tensor_paralel": 2}
    err = error_for(tmp_path, doc)
    assert "exp.toml" in str(err)
    assert "test[0].parallelism.tensor_paralel" in str(err)
    assert "fix:" in str(err)


def test_tokens_per_step_mismatch_suggests_batch(tmp_path: Path) -> None:
    doc = good()
    doc["test"][0]["parallelism"] = {"tp": 2}
    err = error_for(tmp_path, doc)
    assert "tokens per optimizer step differ" in str(err)
    assert "local_batch_size = " in str(err)  # the fix says which batch makes them equal


def test_missing_train_config(tmp_path: Path) -> None:
    doc = good()
    doc["defaults"]["train_config"] = DEBUG_CONFIG.replace("debug.toml", "nope.toml")
    err = error_for(tmp_path, doc)
    assert "defaults.train_config" in str(err) or "train_config" in str(err)
    assert "does not exist" in str(err)


def test_malformed_toml(tmp_path: Path) -> None:
    # Broken on purpose (an unclosed table header): a literal, not the TOML writer.
    path = tmp_path / "exp.toml"
    path.write_text("[control\nname = 1\n")
    with pytest.raises(SpecError) as info:
        load_checked(path, rootdir=ROOT)
    err = info.value
    assert "malformed TOML" in str(err) and "exp.toml" in str(err)


def test_wrong_type(tmp_path: Path) -> None:
    doc = good()
    doc["defaults"]["steps"] = "many"
    err = error_for(tmp_path, doc)
    assert "steps" in str(err) and "integer" in str(err)


def test_bad_schedule(tmp_path: Path) -> None:
    doc = good()
    doc["sweep"][0]["grid"]["pp_schedule"] = ["Zigzag"]
    err = error_for(tmp_path, doc)
    assert "pp_schedule" in str(err) and "Interleaved1F1B" in str(err)


def test_every_schedule_the_trainer_knows_is_a_layout_schedule() -> None:
    """One schedule table (spec/pp_schedules.py): the V schedules the trainer runs are valid in
    an experiment too, with their two stages per rank."""
    for schedule in SCHEDULES:
        layout = ParallelLayout(pp=2, pp_schedule=schedule)
        assert layout.stages_per_rank == (2 if schedule in MULTI_STAGE_SCHEDULES else 1)
    assert ParallelLayout(pp=2, pp_schedule="DualPipeV").stages_per_rank == 2


def test_degrees_that_do_not_divide_the_model(tmp_path: Path) -> None:
    # debug.toml has 4 heads: tp=3 cannot split them.
    doc = good()
    doc["test"][0]["parallelism"]["tp"] = 3
    err = error_for(tmp_path, doc)
    assert "parallelism.tp" in str(err)


def test_more_devices_than_available(tmp_path: Path) -> None:
    exp = load_checked(write(tmp_path, good()), rootdir=ROOT)
    with pytest.raises(SpecError) as info:
        validate_devices(exp.pairs[0], available_devices=2)
    assert "needs 4 devices" in str(info.value) and "--convergence-devices" in str(info.value)


def test_twin_regime_for_bf16(tmp_path: Path) -> None:
    doc = good()
    sweep = doc["sweep"][0]
    sweep["techniques"] = {"param_dtype": "bfloat16"}
    sweep["grid"] = sweep.pop("grid")  # the file's order: techniques before the grid
    exp = load_checked(write(tmp_path, doc), rootdir=ROOT)
    assert exp.pairs[0].regime == "paired"  # fp32 test: step-by-step comparison
    bf16 = exp.pairs[1]
    assert bf16.regime == "twin"  # same seed checkpoint and data, noise measured on a twin
    assert bf16.rule_for("loss").method == "twin"
    assert bf16.rule_for("grad_norm").method == "twin"


@pytest.mark.parametrize(
    ("table", "key", "value", "words"),
    [
        ("defaults", "seed", -1, ("seed", "[0, 2**32)")),
        ("defaults", "seed", 4294967296, ("seed", "[0, 2**32)")),
        ("test", "name", "", ("name", "non-empty")),
        ("test", "name", "a::b", ("name", "'::'")),
        ("test", "name", "../escape", ("name", "'/'")),
        ("defaults", "steps", 1000000000, ("steps", "[1, 10000000]")),
    ],
)
def test_values_that_would_break_later_fail_at_collection(
    tmp_path: Path, table: str, key: str, value: object, words: tuple[str, ...]
) -> None:
    doc = good()
    (doc["test"][0] if table == "test" else doc[table])[key] = value
    err = error_for(tmp_path, doc)
    for word in words:
        assert word in str(err), err
    assert "exp.toml" in str(err) and "fix:" in str(err)


def test_shipped_config_by_short_name_and_a_helpful_error(tmp_path: Path) -> None:
    doc = good()
    doc["defaults"]["train_config"] = "debug"
    exp = load_checked(write(tmp_path, doc), rootdir=tmp_path)
    assert exp.pairs[0].control.train_config.name == "debug.toml"
    doc["defaults"]["train_config"] = "debgu"
    err = error_for(tmp_path, doc)
    assert "no shipped train config named 'debgu'" in str(err) and "'debug'" in str(err)


def test_config_path_found_in_a_parent_folder_up_to_the_rootdir(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.toml").write_text(
        (ROOT / "train_configs" / "debug.toml").read_text()
    )
    nested = tmp_path / "experiments" / "team"
    nested.mkdir(parents=True)
    doc = good()
    doc["defaults"]["train_config"] = "configs/mine.toml"
    write(nested, doc)
    exp = load_checked(nested / "exp.toml", rootdir=tmp_path)
    assert exp.pairs[0].control.train_config == (tmp_path / "configs" / "mine.toml").resolve()


@pytest.mark.parametrize(
    ("techniques", "regime"),
    [
        ({}, "paired"),
        ({"reduce_dtype": "bfloat16"}, "twin"),
        ({"param_dtype": "bfloat16"}, "twin"),
        ({"compile": True}, "twin"),
        ({"deterministic": False}, "twin"),
    ],
)
def test_default_regime_is_paired_only_for_deterministic_fp32(
    tmp_path: Path, techniques: dict[str, Any], regime: str
) -> None:
    doc = good()
    doc["test"][0]["techniques"] = techniques
    exp = load_checked(write(tmp_path, doc), rootdir=ROOT)
    assert exp.pairs[0].regime == regime


def torchtitan(**overrides: str) -> dict[str, Any]:
    return experiment_doc(
        defaults={
            "backend": "torchtitan",
            "backend_options": {"module": "llama3", "config": "llama3_debugmodel"},
            "steps": 10,
            "tier": "nightly",
            **overrides,
        },
        control={"name": "fsdp2", "parallelism": {"dp_shard": 2}},
        tests=[{"name": "fsdp2-tp2", "parallelism": {"dp_shard": 2, "tp": 2}}],
    )


def test_a_torchtitan_job_needs_no_train_config_file(tmp_path: Path) -> None:
    """torchtitan names its config by module + config; the cache key comes from those."""
    path = write(tmp_path, torchtitan())
    (pair,) = load_checked(path, rootdir=tmp_path, max_tier="quick").pairs  # no preflight
    assert pair.test.backend == "torchtitan"
    assert "no train_config" in str(pair.test.train_config)


def test_overrides_as_a_torchtitan_option_string(tmp_path: Path) -> None:
    raw = (
        "--training.seq_len=256 --compile.enable "
        "--lr_scheduler.warmup_steps 2 --job.description='a b'"
    )
    path = write(tmp_path, torchtitan(overrides=raw))
    (pair,) = load_checked(path, rootdir=tmp_path, max_tier="quick").pairs
    assert dict(pair.test.overrides) == {
        "training.seq_len": "256",
        "compile.enable": "true",
        "lr_scheduler.warmup_steps": "2",
        "job.description": "a b",
    }
    bad = write(tmp_path, torchtitan(overrides="training.steps=3"))
    with pytest.raises(SpecError) as info:
        load_checked(bad, rootdir=tmp_path, max_tier="quick")
    assert info.value.key.endswith("overrides") and "--training.steps=10" in info.value.fix


def test_a_command_job_without_train_config_asks_for_its_own_config(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        experiment_doc(
            control={
                "name": "ddp2",
                "backend": "command",
                "backend_options": {"command": "train.py --out {dump_dir}"},
                "parallelism": {"dp_replicate": 2},
            },
            tests=[{"name": "fsdp2", "parallelism": {"dp_shard": 2}}],
        ),
    )
    with pytest.raises(SpecError) as info:
        load_checked(path, rootdir=tmp_path)
    assert "your trainer's config file" in info.value.fix and "debug" not in info.value.fix


def test_an_unnamed_control_is_named_by_its_layout(tmp_path: Path) -> None:
    """A bare "control" read as "[control control]" in progress lines and reports."""
    doc = good()
    del doc["control"]["name"]
    exp = load_checked(write(tmp_path, doc), rootdir=ROOT)
    assert exp.pairs[0].control.name == "fsdp2"
    from convergence.spec.experiment import make_pair

    pair = make_pair(
        name="tp",
        control={"parallelism": {"dp_shard": 2}, "train_config": "debug"},
        test={"parallelism": {"tp": 2, "dp_shard": 2}},
        defaults={"train_config": "debug", "steps": 4},
        rootdir=ROOT,
        regimes=REGISTRY,
    )
    assert pair.control.name == "fsdp2" and pair.test.name == "tp"


@pytest.mark.parametrize(
    ("compare", "parts"),
    [
        ({"loss": "off", "grad_norm": "off"}, None),
        ({"grad_norm": {"method": "allclose", "rtol": 1e-3}}, ("allclose", 1e-3)),
        ({"grad_norm": "paired", "grad_norm_parts": "off"}, None),
        ({"loss": "paired"}, ("paired", None)),
    ],
)
def test_the_per_part_grad_norm_follows_the_grad_norm_unless_named(
    tmp_path: Path, compare: dict[str, Any], parts: tuple[str, float | None] | None
) -> None:
    """An experiment written before grad_norm_parts existed that turns the grad norm off
    (models that differ) must not start failing on it."""
    doc = experiment_doc(
        defaults={"train_config": "debug", "steps": 4, "compare": compare},
        control={"parallelism": {"dp_shard": 2}},
        tests=[{"name": "t", "parallelism": {"dp_shard": 2, "tp": 2}}],
    )
    (pair,) = load_checked(write(tmp_path, doc), rootdir=ROOT).pairs
    rule = next((r for r in pair.rules if r.metric == "grad_norm_parts"), None)
    if parts is None:
        assert rule is None
    else:
        assert rule is not None and (rule.method, rule.rtol) == parts


def test_a_missing_torchtitan_train_config_names_a_torchtitan_fix(tmp_path: Path) -> None:
    """Issue 36: the fix named the built-in trainer's shipped configs ('debug', ...), which
    are no config of torchtitan's; it now names the experiment file itself or no file."""
    path = tmp_path / "experiments" / "torchtitan" / "my_layouts.toml"
    path.parent.mkdir(parents=True)
    path.write_text(
        "[defaults]\n"
        'backend = "torchtitan"\n'
        'train_config = "cpu.toml"\n'
        'backend_options = { module = "llama3", config = "llama3_debugmodel" }\n'
        "[control]\n"
        "parallelism = { dp_shard = 2 }\n"
        "[[test]]\n"
        'name = "tp"\n'
        "parallelism = { dp_shard = 2, tp = 2 }\n"
    )
    with pytest.raises(SpecError) as error:
        load_experiment(path, rootdir=tmp_path, regimes=REGISTRY)
    assert error.value.fix is not None
    assert 'train_config = "my_layouts.toml"' in error.value.fix
    assert "debug" not in error.value.fix


def test_a_missing_builtin_train_config_names_the_shipped_configs(tmp_path: Path) -> None:
    """The built-in trainer's own configs are the shipped ones (its Capabilities say so:
    collection asks, spec/ cannot); a bare parse, knowing no backend, names none."""
    doc = experiment_doc(
        defaults={"train_config": "train_configs/nope.toml", "steps": 4},
        control={"parallelism": {"dp_shard": 2}},
        tests=[{"name": "t", "parallelism": {"dp_shard": 2, "tp": 2}}],
    )
    path = write(tmp_path, doc)
    with pytest.raises(SpecError) as error:
        load_checked(path, rootdir=tmp_path)
    assert error.value.fix is not None and "name a shipped config: 'debug'" in error.value.fix
    with pytest.raises(SpecError) as bare:
        load_experiment(path, rootdir=tmp_path, regimes=REGISTRY)
    assert bare.value.fix is not None and "debug" not in bare.value.fix

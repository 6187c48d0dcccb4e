"""One layout schema (spec/layout.py Layout) for the experiment spec and the built-in trainer.

The spec's ParallelLayout and the trainer's [parallelism] section (ParallelismConfig) declare
no layout field of their own; an unset PP default is None in both, and the outside spellings
stay what they were: the trainer's TOML, overrides and records say 0, and the job keys, the
trainer command lines and run_meta.json's config are byte for byte those of the two-schema
code (the pinned strings below were printed by it, commit 1973a86).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from pathlib import Path

import pytest

from convergence.backends.builtin import BuiltinBackend, job_overrides
from convergence.cache.key import canonical_json
from convergence.configs import shipped_config
from convergence.spec.errors import SpecError
from convergence.spec.job import HOOK_MODES, JobSpec
from convergence.spec.layout import (
    AC_MODES,
    DTYPES,
    LAYOUT_FIELDS,
    PP_DEFAULTED,
    Layout,
    ParallelLayout,
    Techniques,
)
from convergence.spec.pp_schedules import SCHEDULES
from convergence.trainer.config import (
    ActivationCheckpointConfig,
    ParallelismConfig,
    TrainConfig,
    build_train_config,
    load_train_config,
)
from convergence.trainer.config_checks import check_config

DEBUG = shipped_config("debug")
assert DEBUG is not None

PP_JOB = JobSpec(
    name="b",
    train_config=DEBUG,
    layout=ParallelLayout(
        dp_shard=2, tp=2, sequence_parallel=True, pp=2, pp_schedule="Interleaved1F1B"
    ),
    techniques=Techniques(activation_checkpoint="full"),
    local_batch_size=8,
    hook="os.path:join",
    hook_mode="replace_tp",
)


def test_the_layout_fields_are_declared_once() -> None:
    assert issubclass(ParallelLayout, Layout) and issubclass(ParallelismConfig, Layout)
    spec_fields = tuple(f.name for f in dataclasses.fields(ParallelLayout))
    trainer_fields = tuple(f.name for f in dataclasses.fields(ParallelismConfig))
    assert spec_fields == LAYOUT_FIELDS
    # The trainer's own settings come after the shared ones (the order asdict writes).
    assert trainer_fields == (*LAYOUT_FIELDS, "reshard_after_forward", "hook", "hook_mode")
    # Declared by Layout alone: neither subclass writes a layout field again.
    assert set(inspect.get_annotations(ParallelLayout)) == set()
    assert set(inspect.get_annotations(ParallelismConfig)) == {
        "reshard_after_forward",
        "hook",
        "hook_mode",
    }
    assert ParallelismConfig().pp_microbatches is None  # one convention for "unset"


def test_job_keys_are_those_of_the_two_schema_code() -> None:
    identity = PP_JOB.identity()
    identity.pop("train_config")  # an absolute path: machine-dependent
    assert canonical_json(identity) == (
        '{"backend":"builtin","backend_options":[],"hook":"os.path:join","hook_mode":'
        '"replace_tp","layout":{"cp":1,"dp_replicate":1,"dp_shard":2,"pp":2,'
        '"pp_microbatches":null,"pp_schedule":"Interleaved1F1B","pp_stages_per_rank":null,'
        '"sequence_parallel":true,"tp":2},"local_batch_size":8,"overrides":[],"seed":42,'
        '"steps":100,"techniques":{"activation_checkpoint":"full","compile":false,'
        '"cpu_offload":false,"deterministic":true,"grad_accum_steps":1,"param_dtype":'
        '"float32","reduce_dtype":"float32","reshard_after_forward":true}}'
    )


def test_the_trainer_command_line_is_that_of_the_two_schema_code() -> None:
    assert job_overrides(PP_JOB) == [
        "--training.steps=100",
        "--training.seed=42",
        "--parallelism.dp_replicate=1",
        "--parallelism.dp_shard=2",
        "--parallelism.tp=2",
        "--parallelism.sequence_parallel=true",
        "--parallelism.pp=2",
        "--parallelism.pp_schedule=Interleaved1F1B",
        "--parallelism.cp=1",
        "--parallelism.reshard_after_forward=true",
        "--training.param_dtype=float32",
        "--training.reduce_dtype=float32",
        "--training.compile=false",
        "--training.cpu_offload=false",
        "--training.grad_accum_steps=1",
        "--training.deterministic=true",
        "--activation_checkpoint.mode=full",
        "--parallelism.pp_microbatches=4",
        "--parallelism.pp_stages_per_rank=2",
        "--training.local_batch_size=8",
        "--parallelism.hook=os.path:join",
        "--parallelism.hook_mode=replace_tp",
    ]


def test_a_spec_layout_reaches_the_trainer_field_by_field() -> None:
    """The builtin backend's translation: every shared field arrives under its own name, the
    PP defaults resolved the way the trainer resolves them."""
    par = BuiltinBackend().effective_config(PP_JOB).parallelism
    for name in LAYOUT_FIELDS:
        want = getattr(PP_JOB.layout, name)
        if name in PP_DEFAULTED:
            assert want is None
        else:
            assert getattr(par, name) == want, name
    assert (par.pp_microbatches, par.pp_stages_per_rank) == (4, 2)
    assert (par.microbatches, par.stages_per_rank) == (
        PP_JOB.layout.microbatches,
        PP_JOB.layout.stages_per_rank,
    )


def test_the_trainer_files_spell_unset_as_zero_both_ways(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("[parallelism]\npp = 2\npp_microbatches = 0\npp_stages_per_rank = 0\n")
    written_zero = load_train_config(path)
    assert written_zero.parallelism.pp_microbatches is None
    assert written_zero.parallelism == load_train_config(DEBUG, ["--parallelism.pp=2"]).parallelism
    assert load_train_config(path, ["--parallelism.pp_microbatches=4"]).parallelism == (
        ParallelismConfig(pp=2, pp_microbatches=4)
    )
    # The records (run_meta.json's config, resume.json, probe.json) keep the 0 spelling.
    record = written_zero.to_dict()["parallelism"]
    assert record["pp_microbatches"] == 0 and record["pp_stages_per_rank"] == 0
    assert json.dumps(load_train_config(DEBUG).to_dict()["parallelism"]) == (
        '{"dp_replicate": 1, "dp_shard": 1, "tp": 1, "sequence_parallel": false, "pp": 1, '
        '"pp_schedule": "1F1B", "pp_microbatches": 0, "pp_stages_per_rank": 0, "cp": 1, '
        '"reshard_after_forward": true, "hook": "", "hook_mode": "after"}'
    )


def test_closed_choices_are_literals_and_the_checks_list_them() -> None:
    hints = typing.get_type_hints(Layout)
    assert typing.get_args(hints["pp_schedule"]) == SCHEDULES
    assert typing.get_args(typing.get_type_hints(Techniques)["param_dtype"]) == DTYPES
    mode = typing.get_type_hints(ActivationCheckpointConfig)["mode"]
    assert typing.get_args(mode) == AC_MODES
    assert typing.get_args(typing.get_type_hints(ParallelismConfig)["hook_mode"]) == HOOK_MODES
    # The trainer reads a closed choice as a string (a number is a type error naming the key);
    # which strings are valid is check_config's message, listing them.
    with pytest.raises(SpecError) as typed:
        build_train_config({"activation_checkpoint": {"mode": 3}}, [], file="t.toml")
    assert typed.value.key == "activation_checkpoint.mode" and "expected str" in str(typed.value)
    cfg = build_train_config({"activation_checkpoint": {"mode": "some"}}, [], file="t.toml")
    with pytest.raises(SpecError) as unknown:
        check_config(cfg)
    assert unknown.value.key == "activation_checkpoint.mode"
    assert all(choice in str(unknown.value) for choice in AC_MODES)
    assert isinstance(TrainConfig().parallelism, ParallelismConfig)

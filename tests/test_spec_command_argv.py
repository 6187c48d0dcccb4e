"""The command backend's ``command`` as a TOML list is an argv, word for word (issue 24, trap 2:
a list used to be stringified into ``['[python,', 'train.py,', ...]``); a string is split like a
shell; anything else is an error naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from convergence.backends.command import CommandBackend
from convergence.preflight import load_checked
from convergence.spec.errors import SpecError
from experiments import write_experiment


def _experiment(tmp_path: Path, command: Any, **options: Any) -> Path:
    """A command pair whose ``backend_options`` are ``command`` and ``options``."""
    (tmp_path / "trainer.toml").write_text("# the trainer's own config\n")
    return write_experiment(
        tmp_path,
        defaults={
            "train_config": "trainer.toml",
            "backend": "command",
            "backend_options": {"command": command, **(options or {"launch": "direct"})},
            "steps": 3,
        },
        control={"name": "ddp2", "parallelism": {"dp_replicate": 2}},
        tests=[{"name": "fsdp2", "parallelism": {"dp_shard": 2}}],
    )


def _argv(tmp_path: Path, command: Any) -> list[str]:
    experiment = load_checked(_experiment(tmp_path, command), rootdir=tmp_path)
    job = experiment.pairs[0].test
    return CommandBackend().train_entry(job, tmp_path / "dump", None)


def test_a_toml_list_is_the_argv_word_for_word(tmp_path: Path) -> None:
    argv = _argv(
        tmp_path,
        ["python", "my train.py", "--steps", "{steps}", "--out", "{dump_dir}", "--note=a b"],
    )
    assert argv == [
        "python",
        "my train.py",
        "--steps",
        "3",
        "--out",
        str(tmp_path / "dump"),
        "--note=a b",
    ]


def test_a_string_is_split_like_a_shell(tmp_path: Path) -> None:
    argv = _argv(tmp_path, "python 'my train.py' --steps {steps} --tp {tp}")
    assert argv == ["python", "my train.py", "--steps", "3", "--tp", "1"]


@pytest.mark.parametrize("command", [["python", 3], [], {"a": "b"}, 3])
def test_anything_else_is_an_error_naming_the_key(tmp_path: Path, command: Any) -> None:
    with pytest.raises(SpecError) as info:
        load_checked(_experiment(tmp_path, command), rootdir=tmp_path)
    text = str(info.value)
    assert "backend_options.command" in text and "exp.toml" in text, text


def test_a_list_elsewhere_is_json_text_of_strings(tmp_path: Path) -> None:
    """Other list options (e.g. a list of source globs) arrive as JSON text, never a repr;
    a list where the backend wants one word is still that backend's error."""
    path = _experiment(tmp_path, "train.py", launch=["direct"])
    with pytest.raises(SpecError, match="backend_options.launch"):
        load_checked(path, rootdir=tmp_path)
    from convergence.regimes import REGISTRY
    from convergence.spec.experiment import load_experiment

    path = _experiment(tmp_path, "train.py", extra=["a.py", "b/**/*.py"])
    (pair,) = load_experiment(path, rootdir=tmp_path, regimes=REGISTRY).pairs
    assert dict(pair.test.backend_options)["extra"] == '["a.py", "b/**/*.py"]'
    path = _experiment(tmp_path, "train.py", extra=["a.py", 3])
    with pytest.raises(SpecError, match="backend_options.extra"):
        load_experiment(path, rootdir=tmp_path, regimes=REGISTRY)


@pytest.mark.parametrize(
    ("option", "message", "fix"),
    [
        ("launch", "launch must be torchrun or direct", 'set launch = "torchrun"'),
        ("metrics", "metrics must be jsonl or tensorboard", 'set metrics = "jsonl"'),
    ],
)
def test_a_word_outside_an_options_choices_names_them(
    tmp_path: Path, option: str, message: str, fix: str
) -> None:
    path = _experiment(tmp_path, "python train.py", **{option: "srun"})
    with pytest.raises(SpecError) as err:
        load_checked(path, rootdir=tmp_path)
    assert err.value.key is not None and err.value.key.endswith(f"backend_options.{option}")
    assert message in str(err.value) and err.value.fix == fix

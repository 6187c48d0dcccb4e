"""tests/experiments.py, the TOML writer the tests build their experiment files with: what it
writes parses back (tomllib) to the values it was given, and the files it lays out load as
experiments."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from convergence.preflight import load_checked
from experiments import ROOT, builtin_pair, command_pair, dumps, write_experiment

TRICKY = {
    "title": 'quotes " and \\ backslash\nnewline\ttab é ☃',
    "int": -3,
    "float": 1e-05,
    "big": 2.5e300,
    "whole": 2.0,
    "yes": True,
    "no": False,
    "list": [1, 2, 3],
    "empty": [],
    "mixed": ["a", 1.5, True, [1, "x"]],
    "inline": {"dp_shard": 2, "nested": {"optimizer.lr": 1e-3, "k-ey": "v"}},
    "empty_table": {},
    "table": {"a": 1, "sub": {"b": [1, 2]}, "text": "{dump_dir}"},
    "tables": [{"name": "a", "compare": {"loss": "paired"}}, {"name": "b"}],
}


def test_what_is_written_reads_back_as_the_same_values() -> None:
    assert tomllib.loads(dumps(TRICKY)) == TRICKY


def test_floats_keep_every_bit_and_specials_are_written() -> None:
    values = {"third": 1 / 3, "tiny": 5e-324, "inf": math.inf, "ninf": -math.inf}
    assert tomllib.loads(dumps(values)) == values
    assert math.isnan(tomllib.loads(dumps({"nan": math.nan}))["nan"])


def test_a_value_with_no_toml_form_is_an_error() -> None:
    with pytest.raises(TypeError, match="no TOML form"):
        dumps({"none": None})
    with pytest.raises(TypeError, match="no TOML form"):
        dumps({"raw": b"bytes"})  # not silently a list of ints


def test_the_layout_is_the_files_own_tables_in_order(tmp_path: Path) -> None:
    path = write_experiment(
        tmp_path,
        experiment={"tier": "ci"},
        defaults={"steps": 2},
        control={"name": "c"},
        tests=[{"name": "t1"}, {"name": "t2"}],
    )
    headers = [line for line in path.read_text().splitlines() if line.startswith("[")]
    assert headers == ["[experiment]", "[defaults]", "[control]", "[[test]]", "[[test]]"]


def test_the_named_builders_write_experiments_that_load(tmp_path: Path) -> None:
    pair = load_checked(builtin_pair(tmp_path, steps=3, seed=9), rootdir=ROOT).pairs[0]
    assert (pair.control.name, pair.test.name, pair.test.steps, pair.test.seed) == (
        "ddp1",
        "same",
        3,
        9,
    )
    path = command_pair(tmp_path, command=["python", "train.py", "{dump_dir}"])
    (pair,) = load_checked(path, rootdir=ROOT).pairs
    assert pair.test.backend == "command"
    assert dict(pair.test.backend_options)["metrics_file"] == "log.jsonl"

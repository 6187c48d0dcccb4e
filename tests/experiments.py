"""Experiment TOMLs for the tests, built from Python values instead of copied string literals.

``dumps`` is a small TOML writer for the subset experiment files use (tables, arrays of tables,
strings, numbers, bools, arrays, inline tables); ``write_experiment`` lays out the usual
``[experiment]``/``[defaults]``/``[control]``/``[[test]]``/``[[sweep]]`` tables, and the named
builders below are the experiments several test files repeat, with keyword overrides. A test
that checks an error message about broken TOML or a specific byte layout keeps its literal.

Why our own writer: ``tomli_w`` is not a dependency of the package or of the test extras, and
the subset is small; tests/test_experiments_toml.py round-trips it through ``tomllib``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = str(ROOT / "train_configs" / "debug.toml")

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _value(value: Any) -> str:
    """One TOML value, nested tables inline (dicts inside a table are inline tables)."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form: 0.001, 1e-05, 2.0
    if isinstance(value, str | Path):
        # JSON's escapes (\" \\ \n \t \uXXXX ...) are all valid TOML basic-string escapes.
        return json.dumps(str(value))
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r} ({type(value).__name__})")


def _is_table_array(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and bool(value)
        and all(isinstance(v, Mapping) for v in value)
    )


def _table_body(table: Mapping[str, Any]) -> list[str]:
    return [f"{_key(k)} = {_value(v)}" for k, v in table.items()]


def dumps(doc: Mapping[str, Any]) -> str:
    """TOML text of ``doc``: its plain keys first, then each dict as a ``[table]`` and each list
    of dicts as ``[[tables]]``; anything deeper is written inline (``parallelism = { ... }``),
    which is how the experiment files in experiments/ write it too."""
    lines = _table_body({k: v for k, v in doc.items() if not _is_section(v)})
    for key, value in doc.items():
        if isinstance(value, Mapping):
            lines += ["", f"[{_key(key)}]", *_table_body(value)]
        elif _is_table_array(value):
            for table in value:
                lines += ["", f"[[{_key(key)}]]", *_table_body(table)]
    return "\n".join(lines).lstrip("\n") + "\n"


def _is_section(value: Any) -> bool:
    return isinstance(value, Mapping) or _is_table_array(value)


def write_toml(path: Path, doc: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(doc))
    return path


def experiment_doc(
    *,
    defaults: Mapping[str, Any] | None = None,
    control: Mapping[str, Any] | None = None,
    tests: Iterable[Mapping[str, Any]] = (),
    sweeps: Iterable[Mapping[str, Any]] = (),
    experiment: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The experiment file's tables as one dict, in the order the files write them."""
    doc: dict[str, Any] = {}
    if experiment is not None:
        doc["experiment"] = dict(experiment)
    if defaults is not None:
        doc["defaults"] = dict(defaults)
    if control is not None:
        doc["control"] = dict(control)
    if tests := [dict(t) for t in tests]:
        doc["test"] = tests
    if sweeps := [dict(s) for s in sweeps]:
        doc["sweep"] = sweeps
    return doc


def write_experiment(
    folder: Path,
    *,
    file: str = "exp.toml",
    defaults: Mapping[str, Any] | None = None,
    control: Mapping[str, Any] | None = None,
    tests: Iterable[Mapping[str, Any]] = (),
    sweeps: Iterable[Mapping[str, Any]] = (),
    experiment: Mapping[str, Any] | None = None,
) -> Path:
    """Write an experiment file ``folder/file`` and return its path."""
    doc = experiment_doc(
        defaults=defaults, control=control, tests=tests, sweeps=sweeps, experiment=experiment
    )
    return write_toml(folder / file, doc)


def builtin_pair(
    folder: Path,
    *,
    control: Mapping[str, Any] | None = None,
    tests: Iterable[Mapping[str, Any]] | None = None,
    steps: int | None = 4,
    file: str = "exp.toml",
    **defaults: Any,
) -> Path:
    """A built-in-trainer pair on the debug config: a DDP control on 1 rank against the same
    layout; ``control``/``tests`` replace the sides' tables, ``defaults`` add to ``[defaults]``
    (``train_config="debug"`` for the shipped name, ``steps=None`` for none)."""
    head = {"train_config": DEBUG_CONFIG} | ({} if steps is None else {"steps": steps})
    return write_experiment(
        folder,
        file=file,
        defaults={**head, **defaults},
        control=control if control is not None else {"name": "ddp1"},
        tests=tests if tests is not None else [{"name": "same"}],
    )


def command_options(
    command: str | Sequence[str],
    *,
    metrics_file: str = "log.jsonl",
    keys: Mapping[str, str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """``backend_options`` of a command-backend job whose script logs ``train_loss``/``gnorm``."""
    return {
        "command": command,
        **options,
        "metrics_file": metrics_file,
        "keys": dict(keys) if keys is not None else {"loss": "train_loss", "grad_norm": "gnorm"},
    }


# What a plain script cannot feed: no data fingerprint, no per-part grad norms.
SCRIPT_COMPARE: Mapping[str, Any] = {"data_fingerprint": "off", "grad_norm_parts": "off"}
# The command-backend fixture trainer (--steps, --seed, --out, --grad-scale; logs train_loss
# and gnorm to log.jsonl).
COMMAND_TRAINER = ROOT / "tests" / "fixtures" / "command_trainer" / "train.py"


def command_pair(
    folder: Path,
    *,
    command: str | Sequence[str],
    steps: int = 3,
    control: Mapping[str, Any] | None = None,
    tests: Iterable[Mapping[str, Any]] | None = None,
    backend_options: Mapping[str, Any] | None = None,
    keys: Mapping[str, str] | None = None,
    compare: Mapping[str, Any] | None = SCRIPT_COMPARE,
    file: str = "cmd.toml",
    **defaults: Any,
) -> Path:
    """A command-backend pair (``ddp1`` against ``same`` unless ``control``/``tests`` say
    otherwise) running ``command``; ``compare=None`` leaves the default comparisons, and
    ``backend_options`` add to (or replace) the command's options."""
    options = {**command_options(command, keys=keys), **(backend_options or {})}
    return write_experiment(
        folder,
        file=file,
        defaults={
            "train_config": DEBUG_CONFIG,
            "steps": steps,
            "backend": "command",
            **({} if compare is None else {"compare": dict(compare)}),
            **defaults,
            "backend_options": options,
        },
        control=control if control is not None else {"name": "ddp1"},
        tests=tests if tests is not None else [{"name": "same"}],
    )


def fixture_command(*extra: str) -> str:
    """The fixture trainer's command line, as one string the backend splits."""
    return " ".join(
        [str(COMMAND_TRAINER), "--steps {steps} --seed {seed} --out {dump_dir}", *extra]
    )

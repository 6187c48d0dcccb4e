"""Experiment files (TOML) and the Python API, turned into validated PairSpecs.

    [defaults]   shared by every job of the file (train_config, steps, seed, ...)
    [control]    the trusted layout
    [[test]]     one pair per test: the new layout or technique, compared with the control
    [[sweep]]    a grid of tests: name template + base parallelism + grid of values

Everything the file itself can tell is checked here; what needs a backend (its preflight,
tokens per step) or the devices is checked by convergence.preflight. Both run before any job
is launched. This package is the bottom layer: it imports only the standard library, itself
and ``convergence.configs`` (the shipped configs' names and paths; pathlib only).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args

from convergence.configs import shipped_configs
from convergence.spec.errors import SpecError
from convergence.spec.job import HookMode, JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.pair import METHODS, METRICS, ComparisonRule, PairSpec, Tier
from convergence.spec.resume import parse_resume
from convergence.spec.rules import RegimeTable
from convergence.spec.toml_io import (
    check_keys,
    expect,
    expect_choice,
    expect_table,
    read_toml,
    require_key,
    shell_words,
)

TIERS: tuple[Tier, ...] = get_args(Tier)

JOB_KEYS = (
    "name",
    "train_config",
    "steps",
    "seed",
    "backend",
    "local_batch_size",
    "parallelism",
    "techniques",
    "hook",
    "hook_mode",
    "overrides",
    "backend_options",
)
PAIR_KEYS = (
    "compare",
    "regime",
    "replicates",
    "early_stop",
    "golden",
    "tier",
    "probe_on_failure",
    "probe",
)
#: Values of the pair key ``probe``: when the numerics probe runs on both sides.
PROBE_MODES = ("on_failure", "always", "off")
DEFAULTS_KEYS = tuple(k for k in JOB_KEYS if k != "name") + PAIR_KEYS
#: ``resume`` is a test side's only (convergence.spec.resume): a control is uninterrupted.
TEST_KEYS = JOB_KEYS + PAIR_KEYS + ("resume",)
SWEEP_KEYS = ("name", "grid") + tuple(k for k in TEST_KEYS if k != "name")
TOP_KEYS = ("experiment", "defaults", "control", "test", "sweep")
EXPERIMENT_KEYS = ("description", "tier")
RULE_KEYS = tuple(
    f.name for f in dataclasses.fields(ComparisonRule) if f.name not in ("metric", "explicit")
)
LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(ParallelLayout))
TECHNIQUE_KEYS = tuple(f.name for f in dataclasses.fields(Techniques))


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """One experiment file: a control and its tests, as pairs."""

    source: str
    """Path of the TOML file."""
    description: str = ""
    pairs: tuple[PairSpec, ...] = ()
    keys: tuple[str, ...] = ()
    """Where each pair is in the file (``test[0]``, ``sweep[0][tp2]``), for the preflight's
    errors (convergence.preflight)."""


# The tables only an experiment file has. Matched on the raw text, so a file that declares
# itself but does not parse is still one (and its syntax error is reported when it is loaded).
_DECLARES = re.compile(r"^[ \t]*(\[[ \t]*control\b|\[\[[ \t]*(test|sweep)\b)", re.MULTILINE)


def declares_experiment(path: Path) -> bool:
    """Whether a TOML file declares itself an experiment (a ``[control]`` table, ``[[test]]``
    or ``[[sweep]]``): what pytest collects, what the nightly sizes, what ``calibrate`` reads as
    an experiment rather than a train config. False for a file that cannot be read."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return _DECLARES.search(text) is not None


def load_experiment(
    path: Path, *, rootdir: Path, regimes: RegimeTable, checks_keys: Sequence[str] = ()
) -> Experiment:
    """Parse an experiment file (keys, types, values). Raises SpecError naming file, key and
    fix. The checks that need backends or devices are convergence.preflight's:
    ``preflight.load_checked`` is this plus them, what a caller about to run pairs wants.
    ``regimes``: the registered regimes (convergence.regimes.REGISTRY). ``checks_keys``: the
    pair keys the checks own (convergence.checks.pair_keys(): ``anchor_every``, ...), kept
    raw on each pair (``PairSpec.check_keys``) for their check to parse; any other key is
    unknown here."""
    file = str(path)
    data = read_toml(path)
    check_keys(data, TOP_KEYS, file=file, path="")
    meta = expect_table(data.get("experiment", {}), file=file, key="experiment")
    check_keys(meta, EXPERIMENT_KEYS, file=file, path="experiment")
    defaults = expect_table(data.get("defaults", {}), file=file, key="defaults")
    check_keys(defaults, (*DEFAULTS_KEYS, *checks_keys), file=file, path="defaults")
    if "tier" in meta:
        defaults.setdefault("tier", meta["tier"])
    if "control" not in data:
        raise SpecError(
            "no [control] table",
            file=file,
            key="control",
            fix="add a [control] table with the trusted layout, e.g. "
            "parallelism = { dp_shard = 2 }",
        )
    control = expect_table(data["control"], file=file, key="control")
    check_keys(control, JOB_KEYS, file=file, path="control")
    tests = _tests(data, file, checks_keys=tuple(checks_keys))
    if not tests:
        raise SpecError(
            "no [[test]] or [[sweep]] entries",
            file=file,
            key="test",
            fix="add at least one [[test]] with the layout to verify",
        )
    pairs: list[PairSpec] = []
    keys: list[str] = []
    seen: set[str] = set()
    for key, test in tests:
        name = str(test.get("name", ""))
        if name in seen:
            raise SpecError(
                f"duplicate test name {name!r}",
                file=file,
                key=f"{key}.name",
                fix="give every test a unique name",
            )
        seen.add(name)
        pairs.append(
            make_pair(
                name=name,
                control=control,
                test=test,
                defaults=defaults,
                source=file,
                rootdir=rootdir,
                key=key,
                regimes=regimes,
                checks_keys=checks_keys,
            )
        )
        keys.append(key)
    return Experiment(
        source=file,
        description=str(meta.get("description", "")),
        pairs=tuple(pairs),
        keys=tuple(keys),
    )


def _tests(
    data: Mapping[str, Any], file: str, *, checks_keys: tuple[str, ...]
) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    raw_tests = expect(
        data.get("test", []), list, file=file, key="test", what="an array of tables ([[test]])"
    )
    for i, raw in enumerate(raw_tests):
        key = f"test[{i}]"
        test = expect_table(raw, file=file, key=key)
        check_keys(test, (*TEST_KEYS, *checks_keys), file=file, path=key)
        require_key(
            test,
            "name",
            file=file,
            key=key,
            what="test",
            fix='add name = "fsdp2-tp2" (it becomes the pytest item name)',
        )
        out.append((key, test))
    raw_sweeps = expect(
        data.get("sweep", []), list, file=file, key="sweep", what="an array of tables ([[sweep]])"
    )
    for i, raw in enumerate(raw_sweeps):
        out.extend(
            _expand_sweep(
                expect_table(raw, file=file, key=f"sweep[{i}]"),
                f"sweep[{i}]",
                file,
                checks_keys=checks_keys,
            )
        )
    return out


def _expand_sweep(
    sweep: dict[str, Any], key: str, file: str, *, checks_keys: tuple[str, ...]
) -> list[tuple[str, dict[str, Any]]]:
    """A grid over parallelism/technique keys; the name is a template like ``tp{tp}-pp{pp}``."""
    check_keys(sweep, (*SWEEP_KEYS, *checks_keys), file=file, path=key)
    grid = expect_table(sweep.get("grid", {}), file=file, key=f"{key}.grid")
    if not grid:
        raise SpecError(
            "empty grid",
            file=file,
            key=f"{key}.grid",
            fix="give lists of values, e.g. grid = { tp = [1, 2], pp = [1, 2] }",
        )
    template = str(sweep.get("name", "-".join(f"{k}{{{k}}}" for k in grid)))
    axes = []
    for name, values in grid.items():
        if name not in LAYOUT_KEYS and name not in TECHNIQUE_KEYS:
            raise SpecError(
                "unknown grid key",
                file=file,
                key=f"{key}.grid.{name}",
                fix=f"use parallelism or technique keys: {', '.join(LAYOUT_KEYS)}",
            )
        axes.append(
            (
                name,
                expect(values, list, file=file, key=f"{key}.grid.{name}", what="a list of values"),
            )
        )
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        chosen = dict(zip((name for name, _ in axes), combo, strict=True))
        test = {k: v for k, v in sweep.items() if k not in ("grid", "name")}
        par = dict(test.get("parallelism", {}))
        tech = dict(test.get("techniques", {}))
        for name, value in chosen.items():
            (par if name in LAYOUT_KEYS else tech)[name] = value
        test["parallelism"], test["techniques"] = par, tech
        try:
            test["name"] = template.format(**chosen)
        except KeyError as exc:
            raise SpecError(
                f"name template uses {exc} which is not in the grid",
                file=file,
                key=f"{key}.name",
                fix="use only grid keys in {braces}",
            ) from None
        out.append((f"{key}[{test['name']}]", test))
    return out


def frozen_value(value: Any) -> Any:
    """A TOML value as a hashable one (a pair is a frozen, hashable value): lists become
    tuples, tables tuples of (key, value)."""
    if isinstance(value, list):
        return tuple(frozen_value(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, frozen_value(v)) for k, v in value.items())
    return value


def _merge(defaults: Mapping[str, Any], side: Mapping[str, Any]) -> dict[str, Any]:
    """Side values win; tables (parallelism, techniques, overrides, ...) merge key by key."""
    out = dict(defaults)
    for key, value in side.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _resolve_config(
    value: Any, *, file: str, key: str, rootdir: Path, backend: str = JobSpec.backend
) -> Path:
    """A shipped config by short name (``"debug"``), or a path: absolute, or relative to the
    experiment file's folder, then to each parent folder up to (and including) the rootdir."""
    text = expect(value, (str, Path), file=file, key=key, what="a short name or a path string")
    path = Path(text)
    shipped: dict[str, Path] = shipped_configs()  # (train_configs/: mypy sees no mapping)
    if not path.suffix and len(path.parts) == 1:  # a bare name: only the shipped configs
        if text in shipped:
            return shipped[text]
        raise SpecError(
            f"no shipped train config named {text!r}",
            file=file,
            key=key,
            fix=f"use one of {', '.join(map(repr, shipped))} (`convergence "
            "configs` lists them), or a path to your own TOML",
        )
    candidates = (
        [path]
        if path.is_absolute()
        else [
            folder / path for folder in _folders_up(Path(file).resolve().parent, rootdir.resolve())
        ]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise MissingTrainConfig(text, candidates, backend=backend, file=file, key=key)


class MissingTrainConfig(SpecError):
    """A ``train_config`` path that does not exist. Its fix names the shipped configs only
    where they are the job's trainer's (Capabilities.shipped_train_configs: the built-in
    trainer's); another backend (torchtitan: backend_options.module + config) only keys the
    run cache with this file, so its fix names the experiment itself (issue 36). spec/ is
    below the backends: preflight.load_checked asks and words it (:meth:`worded`)."""

    def __init__(
        self,
        text: str,
        candidates: list[Path],
        *,
        backend: str,
        file: str,
        key: str,
        shipped: bool = False,
    ) -> None:
        self.text, self.candidates, self.backend = text, candidates, backend
        if shipped:
            fix = "point it at an existing TOML, or name a shipped config: " + ", ".join(
                map(repr, shipped_configs())
            )
        else:
            fix = (
                f"name an existing file, e.g. this experiment itself (train_config = "
                f'"{Path(file).name}"), or drop train_config if the backend has its own config'
            )
        looked = ", ".join(str(c) for c in candidates)
        super().__init__(
            f"train config {text!r} does not exist (looked in {looked})",
            file=file,
            key=key,
            fix=fix,
        )

    def worded(self, *, shipped: bool) -> MissingTrainConfig:
        """The same error, its fix naming the shipped configs or not."""
        return MissingTrainConfig(
            self.text,
            self.candidates,
            backend=self.backend,
            file=self.file or "",
            key=self.key or "",
            shipped=shipped,
        )


def _folders_up(start: Path, stop: Path) -> list[Path]:
    """``start`` and its parents up to ``stop`` (just ``start`` when it is not below it)."""
    folders = [start]
    if stop != start and stop in start.parents:
        for parent in start.parents:
            folders.append(parent)
            if parent == stop:
                break
    return folders


def _job(
    name: str | None, table: Mapping[str, Any], *, file: str, key: str, rootdir: Path
) -> JobSpec:
    """The JobSpec of one side; ``name`` None: the layout's short name (e.g. "fsdp2-tp2")."""
    backend = str(table.get("backend", JobSpec.backend))
    par = expect_table(table.get("parallelism", {}), file=file, key=f"{key}.parallelism")
    check_keys(par, LAYOUT_KEYS, file=file, path=f"{key}.parallelism")
    tech = expect_table(table.get("techniques", {}), file=file, key=f"{key}.techniques")
    check_keys(tech, TECHNIQUE_KEYS, file=file, path=f"{key}.techniques")
    raw_overrides = table.get("overrides", {})
    overrides = (
        _option_string(raw_overrides, file=file, key=f"{key}.overrides")
        if isinstance(raw_overrides, str)
        else expect_table(raw_overrides, file=file, key=f"{key}.overrides")
    )
    options = expect_table(
        table.get("backend_options", {}), file=file, key=f"{key}.backend_options"
    )
    flat_options = _flatten(options, file=file, key=f"{key}.backend_options")
    try:
        layout = ParallelLayout(**par)
        techniques = Techniques(**tech)
        hook = table.get("hook")
        return JobSpec(
            name=name if name is not None else layout.short_name(),
            # A backend that needs a file says so at preflight (Capabilities.needs_train_config:
            # torchtitan names its config by module + config, a file is optional there).
            train_config=(
                _resolve_config(
                    table["train_config"],
                    file=file,
                    key=f"{key}.train_config",
                    rootdir=rootdir,
                    backend=backend,
                )
                if "train_config" in table
                else Path(NO_TRAIN_CONFIG)
            ),
            layout=layout,
            techniques=techniques,
            steps=expect(
                table.get("steps", 100), int, file=file, key=f"{key}.steps", what="an integer"
            ),
            seed=expect(
                table.get("seed", 42), int, file=file, key=f"{key}.seed", what="an integer"
            ),
            backend=backend,
            local_batch_size=table.get("local_batch_size"),
            hook=None
            if hook is None
            else expect(hook, str, file=file, key=f"{key}.hook", what='"package.module:function"'),
            # JobSpec checks it is one of HOOK_MODES (its message names the choices).
            hook_mode=cast(HookMode, str(table.get("hook_mode", "after"))),
            overrides=tuple((str(k), _scalar_text(v)) for k, v in overrides.items()),
            backend_options=tuple(flat_options),
            source=file,
        )
    except SpecError as exc:
        if exc.file:
            raise
        sub = (
            "parallelism"
            if exc.key in LAYOUT_KEYS
            else ("techniques" if exc.key in TECHNIQUE_KEYS else "")
        )
        path = ".".join(p for p in (key, sub, exc.key or "") if p)
        raise SpecError(exc.detail, file=file, key=path, fix=exc.fix) from None
    except TypeError as exc:
        raise SpecError(str(exc), file=file, key=key, fix="check the value types") from None


NO_TRAIN_CONFIG = "<no train_config>"
"""Stands for a torchtitan job's absent train_config file (its config is module + config)."""


def _option_string(text: str, *, file: str, key: str) -> dict[str, str]:
    """``"--training.steps=10 --compile.enable --x.y 3"`` (a torchtitan-style option string,
    as written on a torchrun command line) -> {"training.steps": "10", "compile.enable":
    "true", "x.y": "3"}. Split like a shell would, but never run through one."""
    words = shell_words(
        text,
        what="the option string",
        file=file,
        key=key,
        fix="quote values with spaces, e.g. '--job.description=\"a b\"'",
    )
    out: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--") or len(word) < 3:
            raise SpecError(
                f"{word!r} is not an option (--section.key=value)",
                file=file,
                key=key,
                fix='write options as "--training.steps=10 --a.b=c"',
            )
        name, eq, value = word[2:].partition("=")
        if not eq:
            following = words[i + 1] if i + 1 < len(words) else None
            if following is not None and not following.startswith("--"):
                value, i = following, i + 1
            else:
                value = "true"  # a bare flag
        out[name] = value
        i += 1
    return out


#: The backend option that may be written as an argv list (``command = ["python",
#: "train.py", "--out", "{dump_dir}"]``); it is stored shell-quoted, so that splitting it like a
#: shell gives the same words back.
ARGV_OPTIONS = ("command",)


def _flatten(
    table: Mapping[str, Any], prefix: str = "", *, file: str = "", key: str = "backend_options"
) -> list[tuple[str, str]]:
    """``{keys = {loss = "l"}}`` -> [("keys.loss", "l")]: backend options stay flat strings.
    A list holds strings only: ``command``'s is an argv, stored shell-quoted; any other is
    stored as JSON text (``["a.py", "b/*.py"]``, which a backend reads back with json or
    ast.literal_eval). Anything else that is no scalar is an error naming the key -- never its
    Python repr."""
    out: list[tuple[str, str]] = []
    for name, value in table.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            out.extend(_flatten(value, f"{path}.", file=file, key=key))
        elif isinstance(value, list):
            argv = path in ARGV_OPTIONS
            if (argv and not value) or not all(isinstance(word, str) for word in value):
                raise SpecError(
                    f"a list here holds strings only, got {value!r}",
                    file=file,
                    key=f"{key}.{path}",
                    fix='write each word as a string: ["python", "train.py", '
                    '"--steps", "{steps}"], or one string split like a shell'
                    if argv
                    else 'write each item as a string: ["a", "b"]',
                )
            out.append((path, shlex.join(value) if argv else json.dumps(value)))
        elif path in ARGV_OPTIONS and not isinstance(value, str):
            raise SpecError(
                f"{value!r} is no command",
                file=file,
                key=f"{key}.{path}",
                fix='write an argv list ["python", "train.py", "--out", '
                '"{dump_dir}"] or one string split like a shell',
            )
        elif isinstance(value, (str, int, float, bool)):
            out.append((path, _scalar_text(value)))
        else:
            raise SpecError(
                f"unsupported value {value!r}",
                file=file,
                key=f"{key}.{path}",
                fix="write a string, a number or a boolean",
            )
    return out


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _rules(
    compare: Mapping[str, Any], defaults: tuple[ComparisonRule, ...], *, file: str, key: str
) -> tuple[ComparisonRule, ...]:
    rules = {r.metric: r for r in defaults}
    for metric, spec in compare.items():
        path = f"{key}.compare.{metric}"
        if metric not in METRICS:
            raise SpecError(
                "unknown metric", file=file, key=path, fix=f"compare one of: {', '.join(METRICS)}"
            )
        if spec == "off":
            rules.pop(metric, None)
            continue
        if isinstance(spec, str):
            spec = {"method": spec}
        spec = expect_table(spec, file=file, key=path)
        check_keys(spec, RULE_KEYS, file=file, path=path)
        if spec.get("method") not in METHODS:
            raise SpecError(
                f"unknown comparison {spec.get('method')!r}",
                file=file,
                key=f"{path}.method",
                fix=f'use one of: {", ".join(METHODS)} or "off"',
            )
        gate_default = metric not in ("tokens_per_s", "peak_mem_mib")
        rules[metric] = ComparisonRule(
            metric=metric, explicit=True, **{"gate": gate_default, **spec}
        )
    # A derived metric follows the metric it refines unless it is named itself: an experiment
    # that turns the grad norm off (models that differ) or judges it its own way means the
    # per-part grad norm too -- written before it existed, it must not start failing.
    for derived, base in FOLLOWS.items():
        if base in compare and derived not in compare:
            if base in rules:
                rules[derived] = dataclasses.replace(rules[base], metric=derived, explicit=False)
            else:
                rules.pop(derived, None)
    return tuple(rules.values())


#: metric -> the metric whose `compare` setting it takes when not named itself.
#: The update's norm follows the grad norm as well: where the gradients may differ (models that
#: differ, a method of one's own) the updates made from them do too.
FOLLOWS: dict[str, str] = {"grad_norm_parts": "grad_norm", "update_norm_parts": "grad_norm"}


def make_pair(
    *,
    name: str,
    control: Mapping[str, Any] | JobSpec,
    test: Mapping[str, Any] | JobSpec,
    defaults: Mapping[str, Any] | None = None,
    compare: Mapping[str, Any] | None = None,
    source: str = "<python>",
    rootdir: Path,
    key: str = "test",
    regimes: RegimeTable,
    checks_keys: Sequence[str] = (),
) -> PairSpec:
    """Build a PairSpec from experiment-file tables (or ready JobSpecs): the Python API.
    Parsed, not preflighted: see convergence.preflight (``make_checked_pair``).
    ``regimes``: the registered regimes (convergence.regimes.REGISTRY): the default regime
    and its rules are theirs."""
    defaults = dict(defaults or {})
    file = source
    test_table = dict(test) if isinstance(test, Mapping) else {}
    if compare:
        test_table["compare"] = {**test_table.get("compare", {}), **compare}
    owned = (*PAIR_KEYS, *checks_keys)
    pair_conf = _merge(
        {k: v for k, v in defaults.items() if k in owned},
        {k: v for k, v in test_table.items() if k in owned},
    )
    job_defaults = {k: v for k, v in defaults.items() if k in JOB_KEYS}
    if isinstance(control, JobSpec):
        control_job = control
    else:
        ctrl = _merge(job_defaults, control)
        # An unnamed control is named by its layout ("fsdp2"): a bare "control" read as
        # "[control control]" in progress lines and reports.
        control_job = _job(
            str(ctrl["name"]) if "name" in ctrl else None,
            ctrl,
            file=file,
            key="control",
            rootdir=rootdir,
        )
    if isinstance(test, JobSpec):
        test_job = test
    else:
        side = _merge(job_defaults, {k: v for k, v in test_table.items() if k in JOB_KEYS})
        test_job = _job(name, side, file=file, key=key, rootdir=rootdir)
        if "resume" in test_table:
            test_job = _with_resume(test_job, test_table["resume"], file=file, key=key)

    regime = pair_conf.get("regime") or regimes.default_for(control_job, test_job)
    expect_choice(regime, regimes.names(), file=file, key=f"{key}.regime", what="regime")
    tier = pair_conf.get("tier", "quick")
    expect_choice(tier, TIERS, file=file, key=f"{key}.tier", what="tier")
    compare_table = expect_table(pair_conf.get("compare", {}), file=file, key=f"{key}.compare")
    probe = pair_conf.get("probe", "on_failure")
    expect_choice(probe, PROBE_MODES, file=file, key=f"{key}.probe", what="probe mode")
    pair = PairSpec(
        pair_id=f"{Path(file).name}::{name}",
        control=control_job,
        test=test_job,
        rules=_same_data_rules(
            _rules(compare_table, regimes.default_rules(regime), file=file, key=key),
            control_job,
            test_job,
        ),
        regime=regime,
        replicates=int(pair_conf.get("replicates", 3)),
        early_stop=bool(pair_conf.get("early_stop", True)),
        source=file,
        tier=cast(Tier, tier),  # one of TIERS: checked above
        probe_on_failure=bool(pair_conf.get("probe_on_failure", True)) and probe != "off",
        probe_always=probe == "always",
        golden=pair_conf.get("golden"),
        check_keys=tuple((k, frozen_value(pair_conf[k])) for k in checks_keys if k in pair_conf),
    )
    return pair


def _with_resume(job: JobSpec, value: Any, *, file: str, key: str) -> JobSpec:
    resume = parse_resume(
        value,
        layout=job.layout,
        techniques=job.techniques,
        file=file,
        key=f"{key}.resume",
    )
    # Here, not in JobSpec: --convergence-steps may cut a run before its resume, which the
    # Runner reports as that pair's error (run/resume.py), not as a broken JobSpec.
    if resume.at_step >= job.steps:
        raise SpecError(
            f"resume.at_step = {resume.at_step} is not inside the run (steps = {job.steps})",
            file=file,
            key=f"{key}.resume.at_step",
            fix=f"set at_step between 1 and {job.steps - 1}",
        )
    return dataclasses.replace(job, resume=resume)


def _same_data_rules(
    rules: tuple[ComparisonRule, ...], control: JobSpec, test: JobSpec
) -> tuple[ComparisonRule, ...]:
    """The data fingerprint is compared only where both sides must read the same samples:
    the seed picks the sample order, so a test with another seed reads other data. Put first:
    a data difference is named before any numerics."""
    data = [rule for rule in rules if rule.metric == "data_fingerprint"]
    rest = tuple(rule for rule in rules if rule.metric != "data_fingerprint")
    return (*data, *rest) if control.seed == test.seed else rest

"""Collecting experiment TOML files: one ``ConvergenceItem`` per control/test pair.

A TOML file is collected as an experiment when it is listed (or lies in a folder listed) in the
ini option ``convergence_paths``, when it is named on the command line, or when it lies inside a
folder named ``experiments`` *and declares itself* (a ``[control]`` table, ``[[test]]`` or
``[[sweep]]``). pytest only visits its ``testpaths`` (most repositories: ``["tests"]``), so a
session that selects convergence tests (``-m convergence``) with no path on the command line
also visits the ``convergence_paths`` (:func:`add_convergence_paths`). Anything else under ``experiments/`` -- a torchtitan job config, a train config
next to an experiment -- is not ours and is silently left alone: installing the plugin must never
break another repository's collection. Item names are the test names:
``experiments/converging.toml::fsdp2-tp2``. Every item carries the ``convergence`` marker.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from convergence.preflight import load_checked, validate_devices
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.experiment import TIERS, declares_experiment
from convergence.spec.pair import PairSpec
from pytest_convergence.execute import check_outcome, execute_pair
from pytest_convergence.failure_section import ConvergenceFailure
from pytest_convergence.stash import get_state

MARKER = "convergence"
MARKER_HELP = (
    "convergence(**defaults): a loss-convergence test. TOML pairs carry it; on a Python test "
    "its keyword arguments (train_config=, steps=, seed=, tier=, ...) are the defaults of the "
    "convergence_pair fixture. Select with -m convergence."
)


def _under(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def is_experiment_file(config: pytest.Config, file_path: Path) -> bool:
    if file_path.suffix != ".toml":
        return False
    root = config.rootpath
    rel_parent = file_path.parent.relative_to(root) if _under(file_path, root) else file_path.parent
    if "experiments" in rel_parent.parts and declares_experiment(file_path):
        return True
    resolved = file_path.resolve()
    for listed in config.getini("convergence_paths"):
        listed = Path(listed).resolve()
        if resolved == listed:
            return True  # named: ours, so its errors are reported
        if listed.is_dir() and _under(resolved, listed) and declares_experiment(file_path):
            return True  # in a listed folder: only files that declare themselves, as above
    for arg in config.args:
        arg_path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if arg_path == resolved:
            return True
    return False


def selects_convergence(markexpr: str) -> bool:
    """Whether ``-m EXPR`` asks for convergence tests: it keeps an item that carries only the
    convergence marker and drops an unmarked one. ``convergence``, ``convergence and not
    slow`` do; ``not convergence``, ``slow``, ``not slow`` and no -m do not (a plain run, or a
    CI's ``-m "not slow"``, must not start training jobs the testpaths do not hold)."""
    if not markexpr:
        return False
    # pytest has no public API for mark expressions; this one is stable across 8.x and 9.x.
    from _pytest.mark.expression import Expression

    def marked(name: str, /, **kwargs: object) -> bool:
        return name == MARKER and not kwargs

    def unmarked(name: str, /, **kwargs: object) -> bool:
        return False

    try:
        expression = Expression.compile(markexpr)
        return expression.evaluate(marked) and not expression.evaluate(unmarked)
    except (pytest.UsageError, SyntaxError, ValueError):  # pytest reports the bad -m itself
        return False


def add_convergence_paths(config: pytest.Config) -> list[Path]:
    """Add the ini option ``convergence_paths`` to what pytest collects when the session
    selects convergence tests (``-m convergence``) and names no path: pytest would otherwise
    visit only its ``testpaths`` (or the invocation folder) and never see the experiments.
    Paths already inside a collected folder are not added twice. Returns the added paths."""
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        return []  # the user named what to collect
    if not selects_convergence(str(config.option.markexpr or "")):
        return []
    have = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    added: list[Path] = []
    for listed in config.getini("convergence_paths"):
        path = Path(listed).resolve()
        if not path.exists() or any(path == h or _under(path, h) for h in have):
            continue
        config.args.append(str(path))
        have.append(path)
        added.append(path)
    return added


def modified_pair(
    config: pytest.Config, pair: PairSpec, *, vetoed: dict[str, str] | None = None
) -> PairSpec:
    """What other plugins make of ``pair`` (``pytest_convergence_modify_pair``), before the
    pair's checks. A veto (``pytest.skip`` in the hook) is recorded in ``vetoed`` by pair name
    (the item is then a skip with the hook's reason); without ``vetoed`` it propagates (a
    ``convergence_pair`` test is skipped)."""
    try:
        return config.hook.pytest_convergence_modify_pair(config=config, pair=pair) or pair
    except pytest.skip.Exception as exc:
        if vetoed is None:
            raise
        vetoed[pair.name] = str(exc.msg or "vetoed by pytest_convergence_modify_pair")
        return pair


class ExperimentFile(pytest.File):
    """An experiment TOML file; invalid input is a clean collection error (nothing runs)."""

    def collect(self) -> Iterator[ConvergenceItem]:
        # A pair this session cannot run (too few devices, a backend not installed) is a
        # skip naming what it needs, so one oversized pair never stops a night's other pairs;
        # --convergence-strict makes it the collection error that every other SpecError is.
        state = get_state(self.config)
        strict = bool(state.options["strict"])
        skipped: dict[str, NotRunnableHere] = {}
        vetoed: dict[str, str] = {}
        try:
            experiment = load_checked(
                self.path,
                rootdir=self.config.rootpath,
                max_tier=state.options["tier"],
                not_runnable=None if strict else skipped,
                modify=functools.partial(modified_pair, self.config, vetoed=vetoed),
            )
            devices = state.device_set()
            pairs = list(experiment.pairs)
            for i, pair in enumerate(pairs):
                if (
                    TIERS.index(pair.tier) > TIERS.index(state.options["tier"])
                    or pair.name in skipped
                ):
                    continue
                try:
                    # The pair as placed: where its jobs run (convergence.launch.placement).
                    pairs[i] = validate_devices(
                        pair, available_devices=devices, device_mode=state.options["device"]
                    )
                except NotRunnableHere as exc:
                    if strict:
                        raise
                    skipped[pair.name] = exc
        except SpecError as exc:
            # CollectError renders as its message only: file, key and fix, no traceback.
            raise self.CollectError(f"invalid experiment (nothing was launched):\n{exc}") from None
        for pair in pairs:
            item = ConvergenceItem.from_parent(self, name=pair.name, pair=pair)
            item.add_marker(MARKER)
            if pair.name in vetoed:
                item.add_marker(pytest.mark.skip(reason=vetoed[pair.name]))
                item.skipped = True
            elif pair.name in skipped:
                item.add_marker(pytest.mark.skip(reason=skip_reason(skipped[pair.name])))
                item.skipped = True
            yield item


class ConvergenceItem(pytest.Item):
    """One control/test pair from an experiment file."""

    def __init__(self, *, pair: PairSpec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pair = pair
        self.skipped = False
        """Carries a skip marker (not runnable in this session)."""

    def runtest(self) -> None:
        check_outcome(execute_pair(self.config, self.pair, self.user_properties), self.config)

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
    ) -> str | Any:
        if isinstance(excinfo.value, ConvergenceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        pair = self.pair
        # A skip marker's report is placed at the item's line, which must be a number.
        return (
            self.path,
            0 if self.skipped else None,
            f"{pair.pair_id}: {pair.test.layout.short_name()} "
            f"vs {pair.control.layout.short_name()}",
        )


def skip_reason(exc: NotRunnableHere) -> str:
    """One line: what the pair needs and how to get it (the file is the item's own)."""
    text = exc.detail + (f" (fix: {exc.fix})" if exc.fix else "")
    return f"not runnable here: {text}"


def collect_file(file_path: Path, parent: pytest.Collector) -> ExperimentFile | None:
    if not is_experiment_file(parent.config, file_path):
        return None
    return ExperimentFile.from_parent(parent, path=file_path)


def item_tier(item: pytest.Item) -> str:
    if isinstance(item, ConvergenceItem):
        return item.pair.tier
    marker = item.get_closest_marker(MARKER)
    if marker is not None and "tier" in marker.kwargs:
        return str(marker.kwargs["tier"])
    return "quick"


def mark_and_deselect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Python tests using the fixture get the marker; pairs above the session tier are
    deselected (counted per tier, reported in the header)."""
    state = get_state(config)
    limit = TIERS.index(state.options["tier"])
    keep, dropped = [], []
    for item in items:
        if "convergence_pair" in getattr(item, "fixturenames", ()):
            if item.get_closest_marker(MARKER) is None:
                item.add_marker(MARKER)
        is_convergence = item.get_closest_marker(MARKER) is not None
        tier = item_tier(item) if is_convergence else "quick"
        if tier in TIERS and TIERS.index(tier) > limit:
            dropped.append(item)
            state.deselected_by_tier[tier] = state.deselected_by_tier.get(tier, 0) + 1
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def tier_note(config: pytest.Config) -> str | None:
    state = get_state(config)
    if not state.deselected_by_tier:
        return None
    counts = ", ".join(
        f"{n} {tier}"
        for tier, n in sorted(state.deselected_by_tier.items(), key=lambda kv: TIERS.index(kv[0]))
    )
    highest = max(state.deselected_by_tier, key=TIERS.index)
    return (
        f"convergence: deselected {counts} pair(s) above --convergence-tier "
        f"{state.options['tier']}; run them with --convergence-tier {highest}"
    )

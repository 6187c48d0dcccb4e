"""The regimes by name: what ``regime = "..."`` may say, and which one a pair gets by default.

A regime is added by writing its module (a class that satisfies
:class:`convergence.regimes.base.Regime`) and one line: its instance in :data:`SHIPPED` below
(or ``REGISTRY.register(...)`` from outside the package, as tests/test_regimes_extension.py
does). Outside this package the library asks the registry and the regimes (their
attributes and methods), never tests a regime's name (tests/test_names_stay_home.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from convergence.regimes.base import Regime
from convergence.regimes.margin import MARGIN
from convergence.regimes.paired import PAIRED
from convergence.regimes.seed import SEED
from convergence.regimes.twin import TWIN
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.pair import ComparisonRule

#: The shipped regimes, in the order the default is asked (``Regime.claims``): margin claims
#: the deliberate numerics changes before the others see them; seed claims every pair, so it
#: comes last.
SHIPPED: tuple[Regime, ...] = (MARGIN, PAIRED, TWIN, SEED)


class RegimeRegistry:
    """Regimes by name, in registration order. Satisfies ``convergence.spec.rules.RegimeTable``,
    the view the experiment parser is given (spec/ imports nothing above it)."""

    def __init__(self, regimes: tuple[Regime, ...]) -> None:
        self._regimes: dict[str, Regime] = {}
        for regime in regimes:
            self.register(regime)

    def register(self, regime: Regime) -> None:
        if regime.name in self._regimes:
            raise ValueError(f"regime {regime.name!r} is registered already")
        self._regimes[regime.name] = regime

    def unregister(self, name: str) -> None:
        self._regimes.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._regimes)

    def all(self) -> tuple[Regime, ...]:
        return tuple(self._regimes.values())

    def get(self, name: str) -> Regime:
        try:
            return self._regimes[name]
        except KeyError:
            raise SpecError(
                f"unknown regime {name!r}",
                key="regime",
                fix=f"use one of {', '.join(self._regimes)}",
            ) from None

    def default_for(self, control: JobSpec, test: JobSpec, *, twins: bool = False) -> str:
        """The first regime (in registration order) that claims the pair (``twins``: both
        sides' backends derive twins by default; :meth:`seen_by` asks the backends)."""
        for regime in self._regimes.values():
            if regime.claims(control, test, twins=twins):
                return regime.name
        raise SpecError(
            "no regime applies to this pair",
            key="regime",
            fix=f"name one: regime = one of {', '.join(self._regimes)}",
        )

    def default_rules(self, name: str) -> tuple[ComparisonRule, ...]:
        return self.get(name).default_rules()

    def seen_by(self, twins_by_default: Callable[[str], bool]) -> BackendAwareRegimes:
        """This registry as the experiment parser sees it (spec.rules.RegimeTable), with
        ``twins_by_default(backend name)`` answering for the pairs' default regime (the
        caller, convergence.preflight, asks the backends: this package imports none)."""
        return BackendAwareRegimes(self, twins_by_default)

    def default_for_runs(self, count: int) -> str:
        """``convergence compare`` without ``--regime``: paired for one control run; with
        more (``--replicate``), the other runs are other seeds' controls: the seed band."""
        return PAIRED.name if count <= 1 else SEED.name


class BackendAwareRegimes:
    """A :class:`RegimeRegistry` whose default regime asks the backends whether they derive
    twins; satisfies ``convergence.spec.rules.RegimeTable``."""

    def __init__(self, registry: RegimeRegistry, twins_by_default: Callable[[str], bool]):
        self._registry = registry
        self._twins_by_default = twins_by_default

    def names(self) -> tuple[str, ...]:
        return self._registry.names()

    def default_for(self, control: JobSpec, test: JobSpec) -> str:
        twins = all(self._twins_by_default(job.backend) for job in (control, test))
        return self._registry.default_for(control, test, twins=twins)

    def default_rules(self, name: str) -> tuple[ComparisonRule, ...]:
        return self._registry.default_rules(name)


REGISTRY = RegimeRegistry(SHIPPED)


def get_regime(name: str) -> Regime:
    """The registered regime called ``name``; SpecError naming the known ones otherwise."""
    return REGISTRY.get(name)


def default_rules(name: str) -> tuple[ComparisonRule, ...]:
    """The default rules of the regime called ``name`` (ValueError when there is none)."""
    return REGISTRY.default_rules(name)


@contextmanager
def registered(regime: Regime) -> Iterator[Regime]:
    """``regime`` registered for the duration of a ``with`` block (tests, plugins' tests)."""
    REGISTRY.register(regime)
    try:
        yield regime
    finally:
        REGISTRY.unregister(regime.name)

"""Checks by name: the shipped ones and those of other packages (entry-point group
``convergence.checks``, each naming a class whose instances follow convergence.checks.base's
Check Protocol). Looked up by import path, like the backends (backends/registry.py): this
package sits below the Runner, and a check module may import what a check needs."""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points

from convergence.checks.base import Check
from convergence.spec.errors import SpecError
from convergence.spec.pair import PairSpec

GROUP = "convergence.checks"

#: In the order they are asked (refusals at collection, extra jobs, verdicts, the probe).
SHIPPED: dict[str, str] = {
    "resumed": "convergence.checks.resumed:ResumedCheck",
    "anchored": "convergence.checks.anchored:AnchoredCheck",
}


@cache
def all_checks() -> tuple[Check, ...]:
    """Every check, the shipped first (in SHIPPED's order), then the entry points' by name."""
    targets = dict(SHIPPED)
    for point in sorted(entry_points(group=GROUP), key=lambda p: p.name):
        targets.setdefault(point.name, point.value)
    out = []
    for name, target in targets.items():
        module, _, attribute = target.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise SpecError(
                f"check {name!r} ({target}) cannot be loaded: {exc}",
                key="checks",
                fix=f"install the package that provides it, or remove its {GROUP} entry point",
            ) from None
        out.append(factory())
    return tuple(out)


def checks_of(pair: PairSpec) -> tuple[Check, ...]:
    """The checks that apply to ``pair`` (as it runs: after the session's settings)."""
    return tuple(check for check in all_checks() if check.applies(pair))


def pair_keys() -> tuple[str, ...]:
    """The pair keys the checks own (what experiment files and the marker may set beside the
    spec's own keys: convergence.spec.experiment.load_experiment's ``checks_keys``)."""
    return tuple(key for check in all_checks() for key in check.keys)


def validate_keys(pair: PairSpec, *, key: str, steps: int | None = None) -> None:
    """Each check's :meth:`~convergence.checks.base.Check.validate` on ``pair``."""
    for check in all_checks():
        check.validate(pair, key=key, steps=steps)

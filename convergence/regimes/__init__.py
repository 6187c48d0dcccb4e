"""Regimes: how a pair is judged (paired, twin, seed), one strategy per module behind the
:class:`~convergence.regimes.base.Regime` Protocol; ``registry.py`` names them."""

from __future__ import annotations

from convergence.regimes.base import (
    ControlCurves,
    EarlyStopPolicy,
    Regime,
    TwinSource,
    resumed_controls,
)
from convergence.regimes.registry import REGISTRY, default_rules, get_regime, registered

__all__ = [
    "REGISTRY",
    "ControlCurves",
    "EarlyStopPolicy",
    "Regime",
    "TwinSource",
    "default_rules",
    "get_regime",
    "registered",
    "resumed_controls",
]

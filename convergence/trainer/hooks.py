"""The hook API's former path, kept so that hooks written against it still import
(``from convergence.trainer.hooks import HookContext``: README's example, benchmarks/detection's
planted bugs, users' own hooks). The code and its documentation live in convergence/rank/hooks.py,
which both trainers use."""

from __future__ import annotations

from convergence.rank.hooks import (
    HookContext,
    HookFn,
    apply_hook,
    find_hook_module,
    load_hook,
    locate_hook_module,
)
from convergence.spec.job import HOOK_MODES

__all__ = [
    "HOOK_MODES",
    "HookContext",
    "HookFn",
    "apply_hook",
    "find_hook_module",
    "load_hook",
    "locate_hook_module",
]

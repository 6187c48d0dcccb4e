"""Block kinds of the built-in model (`model.block_pattern`), without torch.

Kept apart from model.py so that the collection-time config check (config_checks.py) does not
import torch: the pytest process validates every pair before the first job is launched.
The meaning of each kind is in model.py's docstring.
"""

from __future__ import annotations

BLOCK_KINDS: tuple[str, ...] = ("standard", "single_sync", "parallel")


def parse_block_pattern(pattern: str, n_layers: int) -> tuple[str, ...]:
    """ "" -> all "standard"; otherwise one kind per layer, or a pattern repeated over layers."""
    if not pattern.strip():
        return ("standard",) * n_layers
    kinds = tuple(p.strip() for p in pattern.split(",") if p.strip())
    return tuple(kinds[i % len(kinds)] for i in range(n_layers))

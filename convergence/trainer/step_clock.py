"""The optimizer step this rank is on, for code that acts from a step on (late-onset hooks).

A parallelism hook runs once, before the first step; a hook that stands for a bug which only
starts late (after warm-up, after an epoch, after a resume) needs to know the step when the
model runs. The training loop sets it at the start of each step (a resumed job: from K+1), so
``current_step()`` read inside a forward, a data read or an optimizer hook is that step's.
"""

from __future__ import annotations

_current = 0


def current_step() -> int:
    """The step the loop is on (1-based); 0 before the first step."""
    return _current


def set_step(step: int) -> None:
    """Called by the training loop at the start of each step."""
    global _current
    _current = step

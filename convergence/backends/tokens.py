"""What to tell a user whose two sides read different tokens per optimizer step."""

from __future__ import annotations

import dataclasses

from convergence.backends.base import Backend
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec


def batch_fix(backend: Backend, test: JobSpec, ctrl_tokens: int) -> str:
    """The local batch that gives the test the control's tokens per step, asked of the backend
    itself (its tokens per step at local batch 1 and 2): a backend whose tokens do not follow
    the local batch (torchtitan with a global batch size, a command job stating its tokens)
    gets the general fix."""
    generic = "make local batch x DP x grad accumulation equal on both sides"
    try:
        one, two = (
            backend.tokens_per_step(dataclasses.replace(test, local_batch_size=n)) for n in (1, 2)
        )
    except (SpecError, ValueError, TypeError):
        return generic
    if one <= 0 or two != 2 * one:
        return generic
    if ctrl_tokens % one == 0:
        return (
            f"set local_batch_size = {ctrl_tokens // one} on the test "
            f"(its DP degree is {test.layout.dp}; {one} tokens per unit of local batch)"
        )
    return (
        "change the test's local_batch_size or techniques.grad_accum_steps so that "
        "local batch x DP x grad accumulation matches the control"
    )

"""The loss: the mean over every valid token of the global batch, whatever the layout.

global mean loss = (1/N) * sum over the N valid tokens of the step (labels != IGNORE_INDEX),
N counted over all data-parallel ranks and microsteps before the step's forward (read_step).
Each rank, each microstep, computes the SUM of its local token losses times w = D/N, where
D = dp*cp is the number of ranks FSDP/DDP AVERAGE gradients over; backward() sums the
microsteps and the gradient reduction divides by D:
    (1/D) * sum_ranks sum_micro (D/N) * sum_tokens loss = (1/N) * sum loss
-- the gradient of the global mean, also when ranks hold different numbers of valid tokens
(padding, CP chunks of a padded sample). A per-rank mean averaged over ranks would weight
the tokens of a sparsely filled rank more: not the single-device loss. The logged loss is
the same sum: the all-reduce over dp x cp of the local (D/N)-weighted sums, divided by D
(world.average_over). With PP the schedule divides each microbatch loss by the number of
microbatches M (pipeline.build_schedule), so the PP loss function multiplies by M to undo it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from convergence.trainer.data import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TokenWeight:
    """w = D/N of the step (or validation pass) running now; read by the loss function."""

    num_ranks: int
    """D: the ranks that gradients (and the logged loss) are averaged over (dp x cp)."""
    value: float = 1.0

    def use(self, num_tokens: int) -> None:
        """Weight for a global batch holding `num_tokens` valid targets."""
        # A batch without any valid target contributes nothing (0 * sum of nothing = 0).
        self.value = self.num_ranks / max(num_tokens, 1)


def make_loss_fn(weight: TokenWeight, undo_divisor: int = 1) -> LossFn:
    """Weighted sum of the token losses; `undo_divisor` cancels a division applied later."""

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return ce * (weight.value * undo_divisor)

    return loss_fn

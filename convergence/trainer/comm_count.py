"""Count the collectives a training step actually issues (torch's CommDebugMode).

CommDebugMode is a dispatch mode: it sees every collective op that runs in its scope, the
functional collectives DTensor issues for TP redistributions as well as the c10d ops FSDP2 calls
(all-gather, reduce-scatter), and tells forward from backward with its module tracker. It works on
CPU/gloo. Point-to-point sends and receives (pipeline parallelism) are not collectives and are
not counted.

The trainer counts one optimizer step (step 1: every microstep's forward and backward) and
stores the result in run_meta.json under "collectives":

    {"forward": 26, "backward": 25, "total": 51,
     "by_op": {"all_reduce": 49, "all_gather_into_tensor": 2}}

The counting costs a little time on that one step (each op is looked at in Python), which is
why only one step is counted; the regression rule's warm-up already skips step 1's throughput.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The key of run_meta.json that holds the count.
META_KEY = "collectives"


class CollectiveCount:
    """Filled when the `count_collectives` block exits."""

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0
        self.by_op: dict[str, int] = {}

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def to_dict(self) -> dict[str, Any]:
        return {"forward": self.forward, "backward": self.backward, "total": self.total,
                "by_op": dict(sorted(self.by_op.items()))}


def _op_name(op: Any) -> str:
    # An OpOverloadPacket such as c10d_functional.all_reduce or c10d.allgather_ -> "all_reduce".
    return str(getattr(op, "__name__", op)).split(".")[-1].rstrip("_")


@contextmanager
def count_collectives(enabled: bool = True) -> Iterator[CollectiveCount]:
    """Count the collectives issued inside the block (nothing is counted when not enabled)."""
    count = CollectiveCount()
    if not enabled:
        yield count
        return
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        yield count
    counts = mode.comm_module_counts.get("Global", {})
    count.forward = sum(counts.get("forward", {}).values())
    count.backward = sum(counts.get("backward", {}).values())
    for op, num in mode.get_comm_counts().items():
        name = _op_name(op)
        count.by_op[name] = count.by_op.get(name, 0) + num

"""Count the collectives a training step actually issues.

A dispatch mode sees every collective op that runs in its scope: the functional collectives
DTensor issues for TP redistributions as well as the c10d ops FSDP2 calls (all-gather,
reduce-scatter). It counts the same ops as torch's CommDebugMode
(torch.distributed.tensor.debug), but without CommDebugMode's module tracker, whose hooks on
every module break a second forward in one scope (gradient accumulation: IndexError) and the
pipeline schedule's `autograd.grad`. Forward and backward are told apart by whether the
autograd engine is running. Works on CPU/gloo. Point-to-point sends and receives (pipeline
parallelism) are not collectives and are not counted.

The trainer counts one optimizer step (every microstep's forward and backward) and stores the
result in run_meta.json under "collectives":

    {"forward": 26, "backward": 25, "total": 51,
     "by_op": {"all_reduce": 49, "all_gather_into_tensor": 2}}

Counting costs a Python call per op on that one step, which is why only one step is counted;
the regression rule's warm-up already skips that step's throughput.
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
        return {
            "forward": self.forward,
            "backward": self.backward,
            "total": self.total,
            "by_op": dict(sorted(self.by_op.items())),
        }


#: Collective ops by namespace (functional collectives: what DTensor issues; c10d: what
#: FSDP2 and plain torch.distributed calls issue). wait_tensor, barriers and p2p are not counted.
_FUNCTIONAL = {
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
}
COLLECTIVE_OPS: dict[str, frozenset[str]] = {
    "_c10d_functional": frozenset(_FUNCTIONAL | {f"{n}_" for n in _FUNCTIONAL}),
    "c10d_functional": frozenset(_FUNCTIONAL),
    "_c10d_functional_autograd": frozenset(_FUNCTIONAL),
    "c10d": frozenset(
        {
            "_allgather_base_",
            "_reduce_scatter_base_",
            "allgather_",
            "allgather_coalesced_",
            "allgather_into_tensor_coalesced_",
            "allreduce_",
            "allreduce_coalesced_",
            "alltoall_",
            "alltoall_base_",
            "broadcast_",
            "gather_",
            "scatter_",
            "reduce_",
            "reduce_scatter_",
            "reduce_scatter_tensor_coalesced_",
        }
    ),
}


def _op_name(name: str) -> str:
    """A backend-neutral name: c10d "allreduce_" and functional "all_reduce" read alike."""
    name = name.strip("_")
    return {
        "allreduce": "all_reduce",
        "allgather": "all_gather",
        "allgather_base": "all_gather_into_tensor",
        "reduce_scatter_base": "reduce_scatter_tensor",
        "alltoall": "all_to_all",
        "alltoall_base": "all_to_all_single",
    }.get(name, name)


def _counting_mode(count: CollectiveCount) -> Any:
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountingMode(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if any(t is DTensor for t in types):
                # Let DTensor run first: it desugars into the collectives seen next.
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
            if name in COLLECTIVE_OPS.get(getattr(func, "namespace", ""), ()):
                # Inside backward the autograd engine is running a graph task.
                if torch._C._current_graph_task_id() != -1:
                    count.backward += 1
                else:
                    count.forward += 1
                key = _op_name(name)
                count.by_op[key] = count.by_op.get(key, 0) + 1
            return out

    return CountingMode()


@contextmanager
def count_collectives(enabled: bool = True) -> Iterator[CollectiveCount]:
    """Count the collectives issued inside the block (nothing is counted when not enabled)."""
    count = CollectiveCount()
    if not enabled:
        yield count
        return
    with _counting_mode(count):
        yield count

"""Inside a Slurm step: narrow the GPUs to the pool's slice of this node, then exec the job.

    srun ... python -m convergence.launch.step_gpus -- python -m torch.distributed.run ...

Why a wrapper: Slurm writes ``CUDA_VISIBLE_DEVICES`` into a step's tasks itself (the GPUs of
the step: with ``--overlap`` and no GPU request, every GPU the job holds on that node,
renumbered from 0 where cgroups constrain devices), replacing whatever srun exported. So the
device pool cannot hand a slice through the environment; it exports
``CONVERGENCE_NODE_GPUS`` (indices 0..per_node-1 on the node) and this picks those positions
out of the list the step really sees. Without a list (no GPU gres), the indices are used as
they are.
"""

from __future__ import annotations

import os
import sys

from convergence.launch.pool import NODE_GPUS_ENV


def narrowed(indices: str, step_visible: str | None) -> str:
    """``"1,2"`` of step list ``"4,5,6,7"`` -> ``"5,6"``; of no list -> ``"1,2"``."""
    wanted = [int(i) for i in indices.split(",") if i.strip()]
    seen = [d.strip() for d in (step_visible or "").split(",") if d.strip()]
    if not seen:
        return ",".join(str(i) for i in wanted)
    missing = [i for i in wanted if i >= len(seen)]
    if missing:
        raise SystemExit(
            f"step_gpus: {NODE_GPUS_ENV}={indices} but this step sees only "
            f"CUDA_VISIBLE_DEVICES={step_visible}: give the allocation's GPUs to "
            "the step (srun --gpus-per-node, CONVERGENCE_SRUN_ARGS)"
        )
    return ",".join(seen[i] for i in wanted)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m convergence.launch.step_gpus -- COMMAND ...")
    indices = os.environ.pop(NODE_GPUS_ENV, "")
    if indices:
        os.environ["CUDA_VISIBLE_DEVICES"] = narrowed(
            indices, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])

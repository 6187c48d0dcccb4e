"""Naming a hung rank on a Slurm node: run there as a step of the allocation, report as JSON.

    srun --jobid J --overlap --nodelist H1,H2 --ntasks-per-node 1 \\
        python -m convergence.launch.hang_probe STEP_NAME

The ranks of a Slurm job run on other nodes, out of the launcher's reach (convergence/launch/
hang.py looks at local processes). So the Slurm launcher starts this probe on each node of the
hung job: it finds the job's rank processes on its node (their environment carries
``CONVERGENCE_STEP`` = the step's unique name), names stopped ones by their state, sends SIGUSR1
to those that catch it (the faulthandler dump of the built-in trainer and of
``convergence.dist_exit``; its default action would kill), reads each rank's dumped stacks from
its own stderr file (``/proc/<pid>/fd/2``: torchrun's per-rank log, unambiguous even when every
node has a local rank 0) and prints one JSON line: ``{"node": ..., "ranks": [{"rank", "pid",
"state", "where"}]}`` with state ``stopped | zombie | outside | waiting | unknown``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil

from convergence.launch.hang import (
    DUMP_WAIT_S,
    ask_for_stacks,
    dumped_stacks,
    rank_processes,
    rank_state,
    suspect_frame,
    waiting_tail,
)

STEP_ENV = "CONVERGENCE_STEP"


def _step_processes(step: str) -> list[psutil.Process]:
    """The step's processes on this node: Slurm sets ``SLURMD_NODENAME`` in every task's
    environment, which also tells nodes apart where several share one kernel (the test
    cluster's network namespaces share the PID space)."""
    here = os.environ.get("SLURMD_NODENAME")
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get(STEP_ENV) == step and (here is None or env.get("SLURMD_NODENAME") == here):
            found.append(proc)
    return found


def _stderr_text(proc: psutil.Process) -> str:
    try:
        return Path(os.readlink(f"/proc/{proc.pid}/fd/2")).read_text(errors="replace")
    except OSError:
        return ""


def probe(step: str) -> dict[str, object]:
    ranks = rank_processes(_step_processes(step))
    report: list[dict[str, object]] = []
    asked = []
    for rank, proc in sorted(ranks.items()):
        state = rank_state(proc)
        if state is None:
            continue
        if state != "running":
            report.append({"rank": rank, "pid": proc.pid, "state": state, "where": None})
        elif ask_for_stacks(proc):
            asked.append(rank)
    if asked:
        time.sleep(DUMP_WAIT_S)
    for rank in asked:
        proc = ranks[rank]
        stacks = dumped_stacks(_stderr_text(proc))
        where = suspect_frame(stacks) if stacks else None
        seen = "unknown" if not stacks else ("waiting" if where is None else "outside")
        report.append({"rank": rank, "pid": proc.pid, "state": seen, "where": where})
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return {"node": node, "ranks": report}


def describe(reports: list[dict[str, object]]) -> str:
    """The probes' JSON (one per node) as one sentence, like hang.describe_hang's."""
    rows = []
    for rep in reports:
        ranks = rep.get("ranks")
        for row in ranks if isinstance(ranks, list) else []:
            if isinstance(row, dict):
                rows.append((int(row["rank"]), str(rep.get("node")), row))
    rows.sort(key=lambda r: r[0])
    stopped = [
        f"rank {r} on node {n} (pid {row['pid']}) is "
        + (
            "stopped (SIGSTOP or a debugger)"
            if row["state"] == "stopped"
            else "exited but was not reaped"
        )
        for r, n, row in rows
        if row["state"] in ("stopped", "zombie")
    ]
    if stopped:
        return "; ".join(stopped)
    outside = [
        f"rank {r} on node {n} is not in a collective: {row['where']}"
        for r, n, row in rows
        if row["state"] == "outside"
    ]
    waiting = [r for r, _, row in rows if row["state"] == "waiting"]
    if not outside:
        return "every rank waits in a collective" if waiting else ""
    return "; ".join(outside) + waiting_tail(waiting)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m convergence.launch.hang_probe STEP_NAME", file=sys.stderr)
        return 2
    print(json.dumps(probe(argv[0])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

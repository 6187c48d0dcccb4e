"""Which collectives gloo runs on CUDA tensors, for ranks sharing one GPU (issue 38).

Each (collective, world size) runs in its own subprocess of W ranks (torch.multiprocessing,
gloo, every rank on ``cuda:0``): a crash (SIGSEGV, SIGABRT: gloo's ``writev ... Bad address``
on a CUDA pointer), a hang or a wrong sum is recorded as FAIL for that entry and the probe goes
on. Prints a markdown table; ``--json`` writes the results. ``--device cpu`` runs the same on
CPU tensors (the baseline, and a dry run of the probe itself on a machine without a GPU).

    python benchmarks/gloo_cuda_probe.py --json /tmp/gloo.json
    python benchmarks/gloo_cuda_probe.py --device cpu --worlds 2

The layouts' needs (convergence.launch.placement) name these entries: what the table says
FAIL for, a layout whose job would call it is placed on CPU instead of on a shared GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TIMEOUT_S = 120
"""Per entry; a slower one is recorded as hung (a collective waiting forever looks the same)."""


# ----------------------------------------------------------------------------------------------
# The collectives, each run on every rank; return None when the result is right, else why not.


def _t(device: Any, rank: int, n: int = 8) -> Any:
    import torch

    return torch.full((n,), float(rank + 1), device=device)


def all_reduce(dev: Any, rank: int, world: int) -> str | None:
    import torch.distributed as dist

    x = _t(dev, rank)
    dist.all_reduce(x)
    return _expect(x, world * (world + 1) / 2)


def reduce_scatter_tensor(dev: Any, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist

    x = _t(dev, rank, 4 * world)
    out = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(out, x)
    return _expect(out, world * (world + 1) / 2)


def all_gather_into_tensor(dev: Any, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist

    out = torch.empty(4 * world, device=dev)
    dist.all_gather_into_tensor(out, _t(dev, rank, 4))
    want = torch.arange(1, world + 1, dtype=out.dtype).repeat_interleave(4)
    return None if torch.equal(out.cpu(), want) else f"got {out.cpu().tolist()}"


def all_gather(dev: Any, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist

    outs = [torch.empty(4, device=dev) for _ in range(world)]
    dist.all_gather(outs, _t(dev, rank, 4))
    return _expect(torch.stack([o / (i + 1) for i, o in enumerate(outs)]), 1.0)


def broadcast(dev: Any, rank: int, world: int) -> str | None:
    import torch.distributed as dist

    x = _t(dev, rank)
    dist.broadcast(x, src=0)
    return _expect(x, 1.0)


def send_recv(dev: Any, rank: int, world: int) -> str | None:
    import torch.distributed as dist

    x = _t(dev, rank)
    peer = rank ^ 1
    if peer >= world:
        return None
    if rank % 2 == 0:
        dist.send(x, peer)
        dist.recv(x, peer)
    else:
        dist.recv(x, peer)
        dist.send(_t(dev, rank), peer)
    return _expect(x, float(peer + 1))


def batch_isend_irecv(dev: Any, rank: int, world: int) -> str | None:
    """What torch.distributed.pipelining does between stages (its _wait_batch_p2p)."""
    import torch
    import torch.distributed as dist

    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(8, device=dev)
    ops = [dist.P2POp(dist.isend, _t(dev, rank), nxt), dist.P2POp(dist.irecv, got, prev)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return _expect(got, float(prev + 1))


def all_to_all_single(dev: Any, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist

    out = torch.empty(2 * world, device=dev)
    dist.all_to_all_single(out, _t(dev, rank, 2 * world))
    want = torch.arange(1, world + 1, dtype=out.dtype).repeat_interleave(2)
    return None if torch.equal(out.cpu(), want) else f"got {out.cpu().tolist()}"


def functional_all_gather(dev: Any, rank: int, world: int) -> str | None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    out = fc.all_gather_tensor(_t(dev, rank, 4), 0, dist.group.WORLD)
    out = fc.wait_tensor(out) if hasattr(fc, "wait_tensor") else out
    want = torch.arange(1, world + 1, dtype=out.dtype).repeat_interleave(4)
    return None if torch.equal(out.cpu(), want) else f"got {out.cpu().tolist()}"


def functional_all_reduce(dev: Any, rank: int, world: int) -> str | None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    out = fc.all_reduce(_t(dev, rank), "sum", dist.group.WORLD)
    return _expect(fc.wait_tensor(out), world * (world + 1) / 2)


def functional_reduce_scatter(dev: Any, rank: int, world: int) -> str | None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    out = fc.reduce_scatter_tensor(_t(dev, rank, 4 * world), "sum", 0, dist.group.WORLD)
    return _expect(fc.wait_tensor(out), world * (world + 1) / 2)


def _mesh(dev: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dev.type, (world,))


def dtensor_shard_to_replicate(dev: Any, rank: int, world: int) -> str | None:
    """TP's all-gather (a sharded activation or weight made whole)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = _mesh(dev, world)
    d = DTensor.from_local(_t(dev, rank, 4), mesh, [Shard(0)])
    full = d.redistribute(mesh, [Replicate()]).to_local()
    return None if full.numel() == 4 * world else f"shape {tuple(full.shape)}"


def dtensor_partial_to_replicate(dev: Any, rank: int, world: int) -> str | None:
    """TP's all-reduce (a row-wise linear's partial sums)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = _mesh(dev, world)
    d = DTensor.from_local(_t(dev, rank), mesh, [Partial()])
    return _expect(d.redistribute(mesh, [Replicate()]).to_local(), world * (world + 1) / 2)


def dtensor_partial_to_shard(dev: Any, rank: int, world: int) -> str | None:
    """Sequence parallelism's reduce-scatter."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = _mesh(dev, world)
    d = DTensor.from_local(_t(dev, rank, 4 * world), mesh, [Partial()])
    return _expect(d.redistribute(mesh, [Shard(0)]).to_local(), world * (world + 1) / 2)


def _expect(x: Any, value: float) -> str | None:
    import torch

    ok = bool(torch.all(x.detach().cpu() == value))
    return None if ok else f"expected {value}, got {x.detach().cpu().tolist()[:4]}"


COLLECTIVES: dict[str, Callable[[Any, int, int], str | None]] = {
    f.__name__: f
    for f in (
        all_reduce,
        reduce_scatter_tensor,
        all_gather_into_tensor,
        all_gather,
        broadcast,
        send_recv,
        batch_isend_irecv,
        all_to_all_single,
        functional_all_reduce,
        functional_all_gather,
        functional_reduce_scatter,
        dtensor_shard_to_replicate,
        dtensor_partial_to_replicate,
        dtensor_partial_to_shard,
    )
}


# ----------------------------------------------------------------------------------------------
# One entry: W ranks in a child process (``--one``).


def _rank(rank: int, name: str, world: int, device: str, store: str) -> None:
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    problem = COLLECTIVES[name](dev, rank, world)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    if problem:
        raise SystemExit(f"rank {rank}: wrong result: {problem}")


def run_one(name: str, world: int, device: str) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo-probe-") as tmp:
        mp.start_processes(
            _rank,
            args=(name, world, device, os.path.join(tmp, "store")),
            nprocs=world,
            start_method="spawn",
        )


# ----------------------------------------------------------------------------------------------
# The parent: every entry in its own subprocess, in parallel.


def probe(name: str, world: int, device: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    start = time.monotonic()
    cmd = [sys.executable, __file__, "--one", name, "--worlds", str(world), "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        rc: int | None = proc.returncode
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"hung: no result in {timeout:g} s"]
    ok = rc == 0
    return {
        "collective": name,
        "world": world,
        "device": device,
        "ok": ok,
        "rc": rc,
        "why": "" if ok else _why(tail),
        "seconds": round(time.monotonic() - start, 1),
    }


def _why(tail: list[str]) -> str:
    """The telling line of a failed entry's output (signal, gloo error, wrong result)."""
    for key in ("Signal", "signal", "SIGSEGV", "SIGABRT", "gloo", "wrong result", "Error"):
        for line in reversed(tail):
            if key in line:
                return line.strip()[:160]
    return (tail[-1] if tail else "no output")[:160]


def table(results: list[dict[str, Any]], worlds: list[int]) -> str:
    head = "| collective | " + " | ".join(f"{w} ranks" for w in worlds) + " |"
    lines = [head, "|---|" + "---|" * len(worlds)]
    by_key = {(r["collective"], r["world"]): r for r in results}
    for name in COLLECTIVES:
        cells = []
        for w in worlds:
            r = by_key.get((name, w))
            cells.append("-" if r is None else ("OK" if r["ok"] else f"FAIL ({r['why']})"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--only", nargs="*", choices=list(COLLECTIVES))
    parser.add_argument("--parallel", type=int, default=6, help="entries run at once")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per entry")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one, args.worlds[0], args.device)
        return 0
    names = args.only or list(COLLECTIVES)
    jobs = [(n, w) for w in args.worlds for n in names]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        results = list(pool.map(lambda job: probe(job[0], job[1], args.device, args.timeout), jobs))
    import torch

    where = (
        f"{torch.cuda.get_device_name(0)}"
        if args.device == "cuda" and torch.cuda.is_available()
        else "CPU"
    )
    print(f"gloo on {args.device} tensors ({where}), torch {torch.__version__}")
    print(table(results, args.worlds))
    if args.json:
        meta = {"device": args.device, "where": where, "torch": torch.__version__}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How far a tensor-parallel shard's matmul rounds from the unsharded one, per device and dtype.

Issue 28 asks whether GPU kernels (cuBLAS picks a tiling and a split of the reduction per
shape) make a TP layout's legitimate noise larger than on the CPU where the shipped twin floors
were calibrated. A single GPU cannot run a two-rank NCCL job (NCCL refuses two ranks on one
device), but the rounding a TP layout adds is in its matmuls, which one process can reproduce:

- column-parallel (wq/wk/wv/w1/w3): ``x @ W[:, :n/2]`` and ``x @ W[:, n/2:]`` concatenated. Every
  output element has the same reduction over K, so any difference is the kernel choosing another
  algorithm (split-K, another tile order) for the narrower shape.
- row-parallel (wo/w2): ``x[:, :k/2] @ W[:k/2] + x[:, k/2:] @ W[k/2:]``, each partial rounded to
  the dtype and summed in it, as a bf16 all-reduce of two ranks does.
- run to run: the same product twice (non-deterministic kernels would show here).

The difference is ``rms(sharded - whole) / rms(whole)`` in units of the dtype's unit roundoff u
(the amplitude the forward-noise twin perturbs by, convergence/trainer/forward_noise.py): a value
near or below 1 means the shard's rounding is within what the twin already injects; well above
it means the twin understates the layout on that device.

    python benchmarks/gpu_rounding.py --json OUT.json            # measure on this machine
    python benchmarks/gpu_rounding.py --merge a.json b.json      # table + BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch
from _report import write_section

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24}

#: (tokens, K, N): the debug model's and the envelope configs' (A/B/C) linear shapes per rank
#: (local batch x seq tokens; attention dim -> dim, dim -> 4 dim FFN), and one GPU-scale shape.
SHAPES = [
    ("A/debug attn", 512, 64, 64),
    ("A/debug ffn", 512, 64, 256),
    ("B attn", 512, 128, 128),
    ("B ffn", 512, 128, 512),
    ("C ffn", 512, 96, 384),
    ("7B-like ffn", 4096, 4096, 11008),
]


def _rel(a: torch.Tensor, b: torch.Tensor, u: float) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).pow(2).mean().sqrt() / a64.pow(2).mean().sqrt() / u)


def measure(device: str, dtype_name: str, seed: int = 0) -> list[dict[str, Any]]:
    dtype = getattr(torch, dtype_name)
    u = UNIT_ROUNDOFF[dtype_name]
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, m, k, n in SHAPES:
        if device == "cpu" and m * k * n > 2**31:
            continue  # the GPU-scale shape takes minutes on two CPU cores
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        w = (torch.randn(k, n, generator=gen) / k**0.5).to(device=device, dtype=dtype)
        whole = x @ w
        again = x @ w
        col = torch.cat([x @ w[:, : n // 2], x @ w[:, n // 2 :]], dim=1)
        row = x[:, : k // 2] @ w[: k // 2] + x[:, k // 2 :] @ w[k // 2 :]
        # The exact product, for scale: how far each variant is from the true value.
        exact = x.double() @ w.double()
        rows.append(
            {
                "device": device,
                "dtype": dtype_name,
                "shape": name,
                "m_k_n": [m, k, n],
                "run_to_run": _rel(whole, again, u),
                "column_split": _rel(whole, col, u),
                "row_split": _rel(whole, row, u),
                "whole_vs_exact": _rel(exact, whole, u),
                "row_split_vs_exact": _rel(exact, row, u),
            }
        )
    return rows


def run(out: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default too)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [r for d in devices for dt in UNIT_ROUNDOFF for r in measure(d, dt)]
    info = {
        "machine": f"{platform.system()} {platform.machine()}",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "rows": rows,
    }
    out.write_text(json.dumps(info, indent=1))
    print(table([info]))


def table(infos: list[dict[str, Any]]) -> str:
    head = (
        "| machine | device | dtype | shape (tokens, K, N) | run to run | column split | row split "
        "| whole vs exact | row split vs exact |\n|---|---|---|---|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for info in infos:
        where = info["gpu"] or info["machine"]
        for r in info["rows"]:
            if r["device"] == "cpu" and info["gpu"] and len(infos) > 1:
                continue  # the GPU machine's CPU rows repeat this machine's
            lines.append(
                f"| {where}, torch {info['torch']} | {r['device']} | {r['dtype']} | "
                f"{r['shape']} {tuple(r['m_k_n'])} | {r['run_to_run']:.2g} | "
                f"{r['column_split']:.2g} | {r['row_split']:.2g} | {r['whole_vs_exact']:.2g} | "
                f"{r['row_split_vs_exact']:.2g} |"
            )
    return "\n".join(lines)


def floors_table(files: list[Path]) -> str:
    """What each calibration measured (before the margin and the shipped floors), per file."""
    lines = [
        "| stack | control | layouts | regime | metric | max abs diff (paired) or twin noise "
        "max | needed (atol; k) |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for f in files:
        cal = json.loads(f.read_text())
        got, stack = cal["obtained"], cal["stack"]
        where = f"{stack['hardware']}, torch {stack['torch']}"
        for regime, layouts in (("paired", "fp32_layouts"), ("twin", "bf16_layouts")):
            for metric, raw in sorted(got["measured"].get(regime, {}).items()):
                if regime == "paired":
                    figure, need = raw["max_abs_diff"], f"atol {raw['atol_needed']:.2g}"
                else:
                    figure, need = raw["twin_noise_max"], f"k {raw['k_needed']:.2g}"
                lines.append(
                    f"| {where} | {got['control']} | {' '.join(got[layouts])} | {regime} | "
                    f"{metric} | {figure:.3g} | {need} |"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="measure here and write the figures to this file")
    p.add_argument("--merge", type=Path, nargs="+", help="figures files to tabulate")
    p.add_argument(
        "--calibrations", type=Path, nargs="*", default=[], help="calibration files to tabulate"
    )
    p.add_argument("--note", default="", help="a paragraph under the tables")
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    if args.json:
        run(args.json)
    if args.merge:
        infos = [json.loads(f.read_text()) for f in args.merge]
        floors = (
            "Floors measured by `convergence calibrate debug` (30 steps, seed 7; "
            "benchmarks/gpu_check.sh on the GPU): the raw need of the worst layout, before the "
            "margin (x2) and the shipped floors (the calibration keeps max(shipped, 2 x need)).\n\n"
            f"{floors_table(args.calibrations)}\n\n"
            if args.calibrations
            else ""
        )
        body = (
            "## GPU checks: floors and a TP shard's rounding, CPU and GPU "
            "(benchmarks/gpu_check.sh, benchmarks/gpu_rounding.py)\n\n"
            f"{floors}"
            "rms(sharded - whole) / rms(whole) in units of the dtype's unit roundoff u (bf16 "
            "2^-8, fp32 2^-24; TF32 off): column split = the output columns in two halves, row "
            "split = the reduction in two halves summed in the dtype (a 2-rank TP all-reduce), "
            "exact = the float64 product. Random normal inputs, one seed.\n\n"
            f"{table(infos)}\n\n{args.note}"
        )
        print(body)
        if not args.no_append:
            write_section("gpu-checks", body)


if __name__ == "__main__":
    main()

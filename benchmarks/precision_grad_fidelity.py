"""What e4m3 gradients (the planted bug detection_bugs.precision:grads_e4m3) lose against the
recipe's e5m2, measured inside a float8 tensorwise run (docs/precision.md).

    python benchmarks/precision_grad_fidelity.py [--seed 1000] [--steps 40] [--set KEY=VALUE ...]

One 2-rank job (the debug model, bf16 FSDP2, float8 tensorwise, emulated) with this module's
:func:`measure` as its hook: at each step, each float8 linear's gradient of its output (in
high precision, before the backward's cast) is cast both ways with one scale per tensor, as
the recipe does, and compared with itself: the share of its nonzero entries flushed to zero,
and the relative error of the weight gradient (gradient^T @ input) each cast gives. e4m3 has
3 mantissa bits and 2^17.8 of range (448 down to 2^-9), e5m2 2 bits and 2^31.8: the question
is whether on this model the lost range costs more than the extra bit gains. ``--set`` passes
trainer overrides (``model.vocab_size=4096``, ``data.synthetic_concentration=0.01``) to both
jobs, to ask the same question of other models and data.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug.toml"
OUT_ENV = "PRECISION_FIDELITY_OUT"
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` through ``dtype`` with one scale per tensor (amax to the format's max), back."""
    fmax = torch.finfo(dtype).max
    scale = fmax / x.abs().max().clamp(min=1e-12)
    return (x * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def measure(model: nn.Module, ctx: object) -> None:
    """Hook: one JSON line per float8 linear per step per rank into $PRECISION_FIDELITY_OUT."""
    from torchao.float8.float8_linear import Float8Linear

    out = Path(os.environ[OUT_ENV])
    rank = int(os.environ.get("RANK", "0"))
    for name, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        saved: dict[str, torch.Tensor] = {}

        def forward(m: nn.Module, args: Any, output: Any, saved: Any = saved) -> None:
            saved["x"] = args[0].detach().float().reshape(-1, args[0].shape[-1])

        def backward(
            m: nn.Module, gin: Any, gout: Any, saved: Any = saved, name: str = name
        ) -> None:
            g = gout[0].detach().float().reshape(-1, gout[0].shape[-1])
            x = saved["x"]
            exact = g.t() @ x
            row: dict[str, Any] = {"rank": rank, "module": name, "nonzero": int((g != 0).sum())}
            for tag, dtype in FORMATS.items():
                q = cast(g, dtype)
                flushed = (q == 0) & (g != 0)
                row[f"flushed_{tag}"] = int(flushed.sum())
                # Entries are not all alike: the share of |g| lost says how much signal went.
                row[f"flushed_mass_{tag}"] = float(g[flushed].abs().sum() / g.abs().sum())
                row[f"weight_grad_error_{tag}"] = float((q.t() @ x - exact).norm() / exact.norm())
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")

        module.register_forward_hook(forward)
        module.register_full_backward_hook(backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="trainer overrides"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="precision-fidelity-") as tmp:
        root = Path(tmp)
        env = dict(os.environ)
        env[OUT_ENV] = str(root / "fidelity.jsonl")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), str(REPO / "benchmarks"), *filter(None, [env.get("PYTHONPATH")])]
        )
        seed = [f"--training.seed={args.seed}", f"--checkpoint.seed_checkpoint={root / 'seed'}"]
        trainer = ["-m", "convergence.trainer", "--config", str(CONFIG), *seed]
        trainer += [f"--{kv}" for kv in args.set]
        subprocess.run(
            [
                sys.executable,
                *trainer,
                "--checkpoint.create_seed_checkpoint=true",
                f"--metrics.dump_folder={root / 'creator'}",
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                *trainer,
                f"--training.steps={args.steps}",
                "--parallelism.dp_shard=2",
                "--training.param_dtype=bfloat16",
                "--precision.float8=tensorwise",
                "--precision.kernels=emulated",
                "--parallelism.hook=precision_grad_fidelity:measure",
                f"--metrics.dump_folder={root / 'run'}",
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        rows = [json.loads(line) for line in (root / "fidelity.jsonl").read_text().splitlines()]
    seen: collections.Counter[tuple[int, str]] = collections.Counter()
    by_step: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:  # one line per module per rank per step, in step order
        seen[row["rank"], row["module"]] += 1
        by_step[seen[row["rank"], row["module"]]].append(row)
    print(
        "| step | flushed e4m3 | flushed e5m2 | abs(g) mass flushed e4m3 (max) "
        "| weight-grad error e4m3 / e5m2 (median, max) "
        "| linears where e4m3 is worse |"
    )
    print("|---:|---:|---:|---:|---|---:|")
    for step in sorted({1, 2, args.steps // 4, args.steps // 2, args.steps} & set(by_step)):
        rs = by_step[step]
        nonzero = sum(r["nonzero"] for r in rs)
        e4 = [r["weight_grad_error_e4m3"] for r in rs]
        e5 = [r["weight_grad_error_e5m2"] for r in rs]
        worse = sum(a > b for a, b in zip(e4, e5, strict=True))
        print(
            f"| {step} | {sum(r['flushed_e4m3'] for r in rs) / nonzero:.1e} | "
            f"{sum(r['flushed_e5m2'] for r in rs) / nonzero:.1e} | "
            f"{max(r['flushed_mass_e4m3'] for r in rs):.1e} | "
            f"{statistics.median(e4):.4f}, {max(e4):.4f} / {statistics.median(e5):.4f}, "
            f"{max(e5):.4f} | {worse} of {len(rs)} |"
        )


if __name__ == "__main__":
    main()

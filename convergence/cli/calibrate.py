"""``convergence calibrate``: measure the noise floors on this machine and write them to the
calibration file of its stack (convergence/calibration/).

    convergence calibrate debug                         # a shipped train config (~5 min, CPU)
    convergence calibrate experiments/quickstart.toml   # the train config of its first control
    convergence calibrate debug --steps 60 --bf16-layouts ddp2 fsdp2-tp2 fsdp2-cp2

Two small experiments run through the library's Runner (the same seed checkpoint, run cache,
launcher and device pool as a test session), early stopping off so every curve is whole:

- fp32, paired regime: a control FSDP(2) against layouts that only reorder reductions
  (``--fp32-layouts``); their differences give the paired floors (atol) per metric.
- bf16 parameters, twin regime: the same control in bf16, its noise twin (Backend.noise_twin)
  and correct layouts (``--bf16-layouts``); their differences give the twin's rtol and k.

measure.py turns the curves into values (never below the shipped defaults; ``--margin`` times
what the worst layout needed). The file records the stack, the values, and how they were
obtained; every later session on this stack uses it and says so in its verdicts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.calibration.file import Calibration, default_path, write_calibration
from convergence.calibration.measure import paired_floor, twin_floor
from convergence.calibration.select import select_calibration
from convergence.calibration.stack import current_stack, stack_hash
from convergence.cli.common import EXIT_FAILED, EXIT_OK
from convergence.configs import shipped_config
from convergence.preflight import load_checked
from convergence.run.runner import Runner, RunSettings
from convergence.spec.errors import SpecError
from convergence.stats.paired import PAIRED_DEFAULTS
from convergence.stats.twin import TWIN_DEFAULTS, twin_noise

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (pyproject's tomli dependency)
    import tomli as tomllib


@dataclass(frozen=True)
class Layout:
    """A layout a calibration can run: its parallelism table and gradient accumulation."""

    parallelism: dict[str, int]
    grad_accum_steps: int = 1

    @property
    def dp(self) -> int:
        return self.parallelism.get("dp_replicate", 1) * self.parallelism.get("dp_shard", 1)


#: Layouts a calibration can run, by name. "accum2" stays on one device and only reorders the
#: gradient sum (two microsteps): the one reduction-order change a single GPU can show, since
#: NCCL refuses two ranks on one GPU.
LAYOUTS: dict[str, Layout] = {
    "single": Layout({"dp_shard": 1}),
    "accum2": Layout({"dp_shard": 1}, grad_accum_steps=2),
    "ddp2": Layout({"dp_replicate": 2}),
    "fsdp2": Layout({"dp_shard": 2}),
    "fsdp4": Layout({"dp_shard": 4}),
    "hsdp2x2": Layout({"dp_replicate": 2, "dp_shard": 2}),
    "fsdp2-tp2": Layout({"dp_shard": 2, "tp": 2}),
    "fsdp2-cp2": Layout({"dp_shard": 2, "cp": 2}),
}
DEFAULT_CONTROL = "fsdp2"
METRICS = ("loss", "grad_norm", "grad_norm_parts")
DEFAULT_FP32 = ("single", "ddp2")
DEFAULT_BF16 = ("hsdp2x2", "fsdp2-tp2")  # bf16 goes through FSDP2: every layout shards


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "calibrate",
        help="measure the paired/twin noise floors on this machine and write its calibration",
    )
    p.add_argument(
        "source", help="a train config (shipped name or path) or an experiment TOML file"
    )
    p.add_argument("--steps", type=int, default=30, help="steps per job (default 30)")
    p.add_argument(
        "--control",
        default=DEFAULT_CONTROL,
        choices=sorted(LAYOUTS),
        help=f"the control layout (default {DEFAULT_CONTROL}; single: a one-GPU machine)",
    )
    p.add_argument("--seed", type=int, default=7, help="training seed (default 7)")
    p.add_argument(
        "--fp32-layouts",
        nargs="*",
        default=list(DEFAULT_FP32),
        choices=[*sorted(LAYOUTS), "none"],
        metavar="LAYOUT",
        help=f"correct fp32 layouts against FSDP(2) (default {' '.join(DEFAULT_FP32)}; "
        f"known: {', '.join(LAYOUTS)}; none: skip the paired floors)",
    )
    p.add_argument(
        "--bf16-layouts",
        nargs="*",
        default=list(DEFAULT_BF16),
        choices=[*sorted(LAYOUTS), "none"],
        metavar="LAYOUT",
        help=f"correct bf16 layouts against FSDP(2) and its twin (default "
        f"{' '.join(DEFAULT_BF16)}; none: skip the twin)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=2.0,
        help="headroom over the worst layout measured (default 2)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(".convergence"),
        help="run state, and where the calibration goes by default (default .convergence)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the calibration file (default <workdir>/calibration/<stack hash>.json)",
    )
    p.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when a calibration for this stack exists (the nightly's step)",
    )
    p.set_defaults(func=cmd_calibrate)


def _train_config(source: str) -> tuple[str, str | None]:
    """(train config, backend) from a train config or an experiment file's first control."""
    path = Path(source)
    if path.suffix == ".toml" and path.is_file():
        text = path.read_text(encoding="utf-8")
        if any(h in text for h in ("[control]", "[[test]]", "[[sweep]]")):
            pair = load_checked(path, rootdir=Path.cwd()).pairs[0]
            return str(pair.control.train_config), pair.control.backend
        return str(path.resolve()), None
    return source, None


def _local_batch(config: str) -> int:
    """The train config's local batch size (the control's, at DP 2); 8 when it cannot be read
    (a backend's own config format: the preflight then names the value to set)."""
    path = shipped_config(config) or Path(config)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        return int(data["training"]["local_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 8


def _inline(table: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{k} = {v!r}" for k, v in table.items()) + " }"


def experiment_text(
    config: str,
    backend: str | None,
    layouts: list[str],
    *,
    precision: str,
    steps: int,
    seed: int,
    control: str = DEFAULT_CONTROL,
) -> str:
    techniques = 'param_dtype = "bfloat16"' if precision == "bf16" else ""
    # Every layout takes the control's tokens per optimizer step: the local batch scales
    # with the inverse of the DP degree times accumulation (the preflight rejects a pair
    # that does not).
    local = _local_batch(config)
    base = LAYOUTS[control]
    samples = local * base.dp * base.grad_accum_steps

    def tables(layout: Layout) -> list[str]:
        tech = ", ".join(
            t
            for t in (
                techniques,
                f"grad_accum_steps = {layout.grad_accum_steps}"
                if layout.grad_accum_steps > 1
                else "",
            )
            if t
        )
        out = [f"parallelism = {_inline(layout.parallelism)}"]
        if tech:
            out.append(f"techniques = {{ {tech} }}")
        return out

    lines = [
        "[defaults]",
        f"train_config = {config!r}".replace("'", '"'),
        f"steps = {steps}",
        f"seed = {seed}",
        'probe = "off"',
        f'regime = "{"twin" if precision == "bf16" else "paired"}"',
        *([f'backend = "{backend}"'] if backend else []),
        "",
        "[control]",
        f'name = "{control}-{precision}"',
        *tables(base),
        f"local_batch_size = {local}",
    ]
    for name in layouts:
        layout = LAYOUTS[name]
        batch, rest = divmod(samples, layout.dp * layout.grad_accum_steps)
        if rest or batch == 0:
            raise SpecError(
                f"layout {name} cannot keep the control's {samples} samples per step at DP "
                f"{layout.dp} x accumulation {layout.grad_accum_steps}",
                key="--fp32-layouts/--bf16-layouts",
                fix="pick layouts whose DP degree divides it",
            )
        lines += ["", "[[test]]", f'name = "{name}"', *tables(layout)]
        lines.append(f"local_batch_size = {batch}")
    return "\n".join(lines) + "\n"


def _run(text: str, folder: Path, name: str, work_dir: Path) -> list[Any]:
    path = folder / f"{name}.toml"
    path.write_text(text)
    pairs = load_checked(path, rootdir=Path.cwd()).pairs
    runner = Runner(RunSettings(work_dir=work_dir, early_stop=False))
    outcomes = []
    for pair in pairs:
        print(f"calibrate: running {pair.pair_id} ...", file=sys.stderr, flush=True)
        outcome = runner.run_pair(pair)
        if outcome.control is None or outcome.test is None:
            raise SpecError(
                f"calibration pair {pair.pair_id} did not run: {outcome.error}",
                file=str(path),
                fix="run `convergence run` on this file to see the job's log",
            )
        outcomes.append(outcome)
    return outcomes


def measure(
    paired: list[Any], twin: list[Any], *, margin: float
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(paired table, twin table, raw figures) from the outcomes of the two experiments."""
    paired_table: dict[str, Any] = {}
    twin_table: dict[str, Any] = {}
    figures: dict[str, Any] = {"paired": {}, "twin": {}}
    for metric in METRICS:
        if paired:
            control = paired[0].control.metrics.get(metric)
            tests = [o.test.metrics[metric] for o in paired if metric in o.test.metrics]
            if control is not None and tests:
                d = PAIRED_DEFAULTS[metric]
                values, raw = paired_floor(
                    control,
                    tests,
                    {"atol": d.atol, "growth": d.growth, "rtol": d.rtol},
                    margin=margin,
                )
                paired_table[metric], figures["paired"][metric] = values, raw
        if twin:
            control = twin[0].control.metrics.get(metric)
            # Every twin the regime ran (noise, forward-noise): the envelope the verdict builds.
            twins = [t[metric] for t in twin[0].control.twins if metric in t]
            tests = [o.test.metrics[metric] for o in twin if metric in o.test.metrics]
            if control is not None and twins and tests:
                t = TWIN_DEFAULTS[metric]
                values, raw = twin_floor(
                    control,
                    twin_noise(control, twins, pool=t.pool),
                    tests,
                    {"k": t.k, "atol": t.atol, "growth": t.growth, "rtol": t.rtol},
                    margin=margin,
                )
                twin_table[metric], figures["twin"][metric] = values, raw
    # val_loss is logged every few steps only: it takes the loss's floors, as its defaults do.
    for table in (paired_table, twin_table):
        if "loss" in table:
            table["val_loss"] = dict(table["loss"])
    return paired_table, twin_table, figures


def cmd_calibrate(args: argparse.Namespace) -> int:
    started = dt.datetime.now(dt.timezone.utc)
    work_dir = args.workdir.resolve()
    # "none" (or no layout at all) skips that part, as --help says.
    args.fp32_layouts = [name for name in args.fp32_layouts if name != "none"]
    args.bf16_layouts = [name for name in args.bf16_layouts if name != "none"]
    if args.if_missing:
        found = select_calibration(work_dir, explicit=args.out)
        if found.calibration is not None:
            print(f"calibration for stack {found.stack_hash} exists: {found.path}; nothing to do")
            return EXIT_OK
        print(found.note, file=sys.stderr)
    folder = work_dir / "calibration" / "runs"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        config, backend = _train_config(args.source)
        common: dict[str, Any] = dict(steps=args.steps, seed=args.seed, control=args.control)
        paired = (
            _run(
                experiment_text(config, backend, args.fp32_layouts, precision="fp32", **common),
                folder,
                "fp32",
                work_dir,
            )
            if args.fp32_layouts
            else []
        )
        twin = (
            _run(
                experiment_text(config, backend, args.bf16_layouts, precision="bf16", **common),
                folder,
                "bf16",
                work_dir,
            )
            if args.bf16_layouts
            else []
        )
    except SpecError as exc:
        print(f"convergence calibrate: {exc}", file=sys.stderr)
        return EXIT_FAILED
    paired_table, twin_table, figures = measure(paired, twin, margin=args.margin)
    stack = current_stack()
    digest = stack_hash(stack)
    calibration = Calibration(
        stack_hash=digest,
        stack=stack,
        paired=paired_table,
        twin=twin_table,
        obtained={
            "source": args.source,
            "train_config": config,
            "backend": backend or "builtin",
            "steps": args.steps,
            "seed": args.seed,
            "control": args.control,
            "fp32_layouts": list(args.fp32_layouts),
            "bf16_layouts": list(args.bf16_layouts),
            "margin": args.margin,
            "date": started.isoformat(timespec="seconds"),
            "wall_s": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 1),
            "measured": figures,
        },
    )
    path = write_calibration(calibration, args.out or default_path(work_dir, digest))
    print(f"calibration for stack {digest} ({stack['hardware']}, torch {stack['torch']})")
    for regime, table in (("paired (fp32)", paired_table), ("twin (bf16)", twin_table)):
        for metric, values in table.items():
            shown = ", ".join(f"{k} {v:.3g}" for k, v in values.items())
            print(f"  {regime:14s} {metric:16s} {shown}")
    print(f"written to {path}")
    return EXIT_OK

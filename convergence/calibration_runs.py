"""The runs behind ``convergence calibrate``: two small experiments, built as pairs, run
through the session Runner with early stopping off (every curve whole), and measured into the
floor tables of a calibration file (convergence/calibration/).

- fp32, paired regime (:data:`FP32`): a control against layouts that only reorder reductions;
  their differences give the paired floors (atol) per metric.
- bf16 parameters, twin regime (:data:`BF16`): the same control in bf16, its noise twin
  (Backend.noise_twin) and correct layouts; their differences give the twin's rtol and k.

The pairs are built by the spec's own constructors (:class:`~convergence.spec.job.JobSpec`,
:class:`~convergence.spec.layout.ParallelLayout`, ``make_checked_pair``): checked like an
experiment file's, with no file in between. Here, above ``calibration/``, because running
needs the Runner and measuring the statistics' defaults, both layers above it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.calibration.measure import paired_floor, twin_floor
from convergence.configs import shipped_config
from convergence.preflight import load_checked, make_checked_pair
from convergence.run.outcome import PairOutcome
from convergence.run.session import SessionRunner
from convergence.spec.errors import RunFailed, SpecError
from convergence.spec.experiment import declares_experiment
from convergence.spec.job import JobSpec
from convergence.spec.layout import DType, ParallelLayout, Techniques
from convergence.spec.pair import PairSpec
from convergence.stats.paired_band import PAIRED_DEFAULTS
from convergence.stats.twin_envelope import TWIN_DEFAULTS, twin_noise


@dataclass(frozen=True)
class Preset:
    """A layout a calibration can run: its degrees and gradient accumulation."""

    layout: ParallelLayout
    grad_accum_steps: int = 1

    @property
    def batches_per_step(self) -> int:
        """Local batches summed per optimizer step (DP degree x accumulation)."""
        return self.layout.dp * self.grad_accum_steps


#: Layouts a calibration can run, by name. "accum2" stays on one device and only reorders the
#: gradient sum (two microsteps): the one reduction-order change a single GPU can show, since
#: NCCL refuses two ranks on one GPU.
PRESETS: dict[str, Preset] = {
    "single": Preset(ParallelLayout()),
    "accum2": Preset(ParallelLayout(), grad_accum_steps=2),
    "ddp2": Preset(ParallelLayout(dp_replicate=2)),
    "fsdp2": Preset(ParallelLayout(dp_shard=2)),
    "fsdp4": Preset(ParallelLayout(dp_shard=4)),
    "hsdp2x2": Preset(ParallelLayout(dp_replicate=2, dp_shard=2)),
    "fsdp2-tp2": Preset(ParallelLayout(dp_shard=2, tp=2)),
    "fsdp2-cp2": Preset(ParallelLayout(dp_shard=2, cp=2)),
}
DEFAULT_CONTROL = "fsdp2"
#: The metrics whose floors are measured (val_loss takes the loss's: it is logged every few
#: steps only, as its defaults do).
METRICS = ("loss", "grad_norm", "grad_norm_parts")


@dataclass(frozen=True)
class Precision:
    """One of the two experiments: the parameters' dtype, the regime that judges it and the
    layouts it runs by default."""

    name: str
    regime: str
    param_dtype: DType
    default_layouts: tuple[str, ...]


FP32 = Precision("fp32", regime="paired", param_dtype="float32", default_layouts=("single", "ddp2"))
# bf16 goes through FSDP2: every layout shards.
BF16 = Precision(
    "bf16", regime="twin", param_dtype="bfloat16", default_layouts=("hsdp2x2", "fsdp2-tp2")
)
PRECISIONS = (FP32, BF16)


@dataclass(frozen=True)
class Source:
    """What the calibration trains: a train config and the backend that runs it."""

    train_config: Path
    backend: str = JobSpec.backend


def read_source(source: str, *, rootdir: Path) -> Source:
    """A shipped train config by name, a train config file, or an experiment file (the train
    config and backend of its first control)."""
    path = Path(source)
    if path.is_file():
        if declares_experiment(path):
            control = load_checked(path, rootdir=rootdir).pairs[0].control
            return Source(control.train_config, control.backend)
        return Source(path.resolve())
    shipped = shipped_config(source)
    if shipped is None:
        raise SpecError(
            f"no shipped train config named {source!r} and no such TOML file",
            key="source",
            fix="name a shipped config (`convergence configs` lists them), a train config "
            "TOML or an experiment file",
        )
    return Source(shipped)


def _local_batch(config: Path) -> int:
    """The train config's local batch size (the control's); 8 when it cannot be read (a
    backend's own config format: the preflight then names the value to set)."""
    try:
        data = tomllib.loads(config.read_text(encoding="utf-8"))
        return int(data["training"]["local_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 8


def calibration_pairs(
    source: Source,
    layouts: Sequence[str],
    precision: Precision,
    *,
    steps: int,
    seed: int,
    control: str = DEFAULT_CONTROL,
    rootdir: Path,
) -> list[PairSpec]:
    """One pair per layout of ``layouts`` (names of :data:`PRESETS`) against ``control``, in
    ``precision``, checked as an experiment file's pairs are (SpecError naming the layout)."""
    where = f"calibrate-{precision.name}"
    flag = f"--{precision.name}-layouts"  # where the user named the layouts

    def job(name: str, preset: Preset, local_batch_size: int) -> JobSpec:
        return JobSpec(
            name=name,
            train_config=source.train_config,
            layout=preset.layout,
            techniques=Techniques(
                param_dtype=precision.param_dtype, grad_accum_steps=preset.grad_accum_steps
            ),
            steps=steps,
            seed=seed,
            backend=source.backend,
            local_batch_size=local_batch_size,
            source=where,
        )

    # Every layout takes the control's samples per optimizer step: the local batch scales
    # with the inverse of the DP degree times accumulation (the preflight rejects a pair
    # that does not).
    base = PRESETS[control]
    local = _local_batch(source.train_config)
    samples = local * base.batches_per_step
    control_job = job(f"{control}-{precision.name}", base, local)
    pairs = []
    for name in layouts:
        preset = PRESETS[name]
        batch, rest = divmod(samples, preset.batches_per_step)
        if rest or batch == 0:
            raise SpecError(
                f"layout {name} cannot keep the control's {samples} samples per step at DP "
                f"{preset.layout.dp} x accumulation {preset.grad_accum_steps}",
                key=flag,
                fix="pick layouts whose DP degree divides it",
            )
        pairs.append(
            make_checked_pair(
                name=name,
                control=control_job,
                test=job(name, preset, batch),
                defaults={"regime": precision.regime, "probe": "off", "early_stop": False},
                source=where,
                rootdir=rootdir,
                key=flag,
            )
        )
    return pairs


def run_pairs(
    pairs: Sequence[PairSpec],
    runner: SessionRunner,
    *,
    on_start: Callable[[PairSpec], None] | None = None,
) -> list[PairOutcome]:
    """Every pair's outcome, both sides run. Raises :class:`RunFailed` for a pair that did not
    run (its curves are what is measured: a verdict is not asked for)."""
    outcomes = []
    for pair in pairs:
        if on_start is not None:
            on_start(pair)
        outcome = runner.run_pair(pair)
        if outcome.control is None or outcome.test is None:
            raise RunFailed(f"calibration pair {pair.pair_id} did not run: {outcome.error}")
        outcomes.append(outcome)
    return outcomes


@dataclass(frozen=True)
class Floors:
    """What the two experiments measured: a calibration file's tables and raw figures."""

    paired: dict[str, Any]
    twin: dict[str, Any]
    figures: dict[str, Any]


def measure(paired: Sequence[PairOutcome], twin: Sequence[PairOutcome], *, margin: float) -> Floors:
    """The floor tables from the outcomes of the two experiments (either may be empty):
    never below the shipped defaults, ``margin`` times what the worst layout needed
    (calibration/measure.py)."""
    paired_table: dict[str, Any] = {}
    twin_table: dict[str, Any] = {}
    figures: dict[str, Any] = {"paired": {}, "twin": {}}
    for metric in METRICS:
        control = paired[0].control.metrics.get(metric) if paired and paired[0].control else None
        tests = [o.test.metrics[metric] for o in paired if o.test and metric in o.test.metrics]
        if control is not None and tests:
            d = PAIRED_DEFAULTS[metric]
            defaults = {"atol": d.atol, "growth": d.growth, "rtol": d.rtol}
            paired_table[metric], figures["paired"][metric] = paired_floor(
                control, tests, defaults, margin=margin
            )
        side = twin[0].control if twin else None
        control = side.metrics.get(metric) if side else None
        # Every twin the regime ran (noise, forward-noise): the envelope the verdict builds.
        twins = [t[metric] for t in side.twins if metric in t] if side else []
        tests = [o.test.metrics[metric] for o in twin if o.test and metric in o.test.metrics]
        if control is not None and twins and tests:
            t = TWIN_DEFAULTS[metric]
            defaults = {"k": t.k, "atol": t.atol, "growth": t.growth, "rtol": t.rtol}
            twin_table[metric], figures["twin"][metric] = twin_floor(
                control, twin_noise(control, twins, pool=t.pool), tests, defaults, margin=margin
            )
    for table in (paired_table, twin_table):
        if "loss" in table:
            table["val_loss"] = dict(table["loss"])
    return Floors(paired=paired_table, twin=twin_table, figures=figures)

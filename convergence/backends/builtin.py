"""The built-in reference trainer (``python -m convergence.trainer``) as a backend."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import convergence
from convergence.backends.base import Capabilities, CodeIdentity
from convergence.backends.effective import once_per_job
from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import read_jsonl
from convergence.rank.hooks import find_hook_module
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import LAYOUT_FIELDS, PP_DEFAULTED, PRECISION_DEFAULTS
from convergence.spec.pp_schedules import TORCH_FLOORS as PP_TORCH_FLOORS
from convergence.spec.run_dir import DumpDir
from convergence.torch_info import older_than, torch_version
from convergence.torchao_info import torchao_version
from convergence.trainer.config import TrainConfig, load_train_config, to_overrides
from convergence.trainer.config_checks import check_config
from convergence.trainer.forward_noise import UNIT_ROUNDOFF
from convergence.trainer.precision_here import check_precision_here
from convergence.trainer.precision_here import enabled as precision_enabled

TRAINER_MODULE = "convergence.trainer"


def job_overrides(job: JobSpec) -> list[str]:
    """The trainer's ``--section.key=value`` settings that realise the job's spec."""
    layout, tech = job.layout, job.techniques
    values: dict[str, Any] = {
        "training.steps": job.steps,
        "training.seed": job.seed,
        # The spec's layout and the trainer's [parallelism] share one schema (spec/layout.py
        # Layout): each field under its own name. The PP defaults go last, resolved, and only
        # with PP (the trainer resolves an unset one the same way: spec/pp_schedules.py).
        **{
            f"parallelism.{name}": getattr(layout, name)
            for name in LAYOUT_FIELDS
            if name not in PP_DEFAULTED and (name != "ep" or layout.ep > 1)
        },
        "parallelism.reshard_after_forward": tech.reshard_after_forward,
        "training.param_dtype": tech.param_dtype,
        "training.reduce_dtype": tech.reduce_dtype,
        "training.compile": tech.compile,
        "training.cpu_offload": tech.cpu_offload,
        "training.grad_accum_steps": tech.grad_accum_steps,
        "training.deterministic": tech.deterministic,
        "activation_checkpoint.mode": tech.activation_checkpoint,
        # The precision techniques only when on (PRECISION_DEFAULTS): a job without them has
        # the command line (and job key) it had before they existed.
        **{
            f"precision.{name}": getattr(tech, name)
            for name, default in PRECISION_DEFAULTS.items()
            if getattr(tech, name) != default
        },
    }
    if layout.pp > 1:
        values["parallelism.pp_microbatches"] = layout.microbatches
        values["parallelism.pp_stages_per_rank"] = layout.stages_per_rank
    if job.local_batch_size is not None:
        values["training.local_batch_size"] = job.local_batch_size
    if job.hook:
        values["parallelism.hook"] = job.hook
        values["parallelism.hook_mode"] = job.hook_mode
    # User overrides come last so they win over the spec-derived values; then what the
    # library asks of the trainer (its checkpoint keys are its words for the request).
    return to_overrides(values) + [
        f"--{k}={v}" for k, v in (*job.overrides, *job.request.as_overrides())
    ]


def probe_flags(job: JobSpec) -> list[str]:
    """The request's numerics probe (none: no words). training.steps stays the job's: the LR
    schedule of the replayed steps depends on it."""
    step = job.request.probe_step
    if not step:
        return []
    return ["--probe.enable=true", f"--probe.step={step}", "--metrics.enable_tensorboard=false"]


class BuiltinBackend:
    name = "builtin"
    capabilities = Capabilities(
        resume=True,
        probe=True,
        anchors=True,
        twins_by_default=True,
        device_follows_placement=True,
        shipped_train_configs=True,
        train_config_fix='set train_config = "debug" (a shipped config) in [defaults]',
    )

    def version(self) -> str:
        return f"builtin-{convergence.__version__}"

    def code_identity(self, job: JobSpec) -> CodeIdentity:
        # The installed package's version is in the key; a repository holding the package
        # (bisecting pytest-convergence itself) names it by its tree.
        return CodeIdentity(keyed=True, packages=("convergence",))

    @once_per_job  # asked by most methods here, at collection and again by the runner
    def effective_config(self, job: JobSpec) -> TrainConfig:
        """The train config TOML with the job's settings applied (backends/effective.py)."""
        return load_train_config(job.train_config, job_overrides(job))

    def preflight(self, job: JobSpec) -> None:
        if job.hook:  # located, not imported: see find_hook_module
            find_hook_module(job.hook, file=job.source, key="hook")
        cfg = self.effective_config(job)
        check_config(cfg, job.world_size)  # torch-free: see blocks.py
        check_precision_here(cfg, file=job.source)
        schedule = job.layout.pp_schedule
        floor = PP_TORCH_FLOORS.get(schedule) if job.layout.pp > 1 else None
        if floor is not None and older_than(torch_version(), floor):
            # Valid, just not on this torch: skipped with the reason (load_checked).
            raise NotRunnableHere(
                f"parallelism.pp_schedule {schedule!r} needs torch >= {floor} (its pipeline "
                f"schedule class is not in older torch); this is torch {torch_version()}",
                file=job.source,
                key="parallelism.pp_schedule",
                fix=f"install torch >= {floor}, or use another schedule on this torch",
            )

    def tokens_per_step(self, job: JobSpec) -> int:
        cfg = self.effective_config(job)
        return (
            cfg.training.local_batch_size
            * job.layout.dp
            * cfg.training.grad_accum_steps
            * cfg.data.seq_len
        )

    def noise_twin(self, job: JobSpec) -> JobSpec | None:
        """The same seed checkpoint, samples, precision and techniques, with another
        data-parallel degree, so its gradients are reduced in another order and rounded at
        other points -- legitimate noise only.

        Twice the FSDP degree with half the local batch where the local batch is even (every
        optimizer step reads the very same samples: convergence.trainer.data.BatchPlan); else
        half the FSDP degree with twice the gradient accumulation (fewer ranks, same samples).
        Raises SpecError with a fix when neither keeps the tokens per step.
        """
        cfg = self.effective_config(job)
        layout, tech = job.layout, job.techniques
        local = cfg.training.local_batch_size
        if local % 2 == 0:
            twin = dataclasses.replace(
                job,
                name=f"{job.name}-twin",
                local_batch_size=local // 2,
                layout=dataclasses.replace(layout, dp_shard=layout.dp_shard * 2),
            )
        elif layout.dp_shard % 2 == 0 and (layout.dp_shard // 2) * layout.cp > 1:
            twin = dataclasses.replace(
                job,
                name=f"{job.name}-twin",
                layout=dataclasses.replace(layout, dp_shard=layout.dp_shard // 2),
                techniques=dataclasses.replace(tech, grad_accum_steps=tech.grad_accum_steps * 2),
            )
        else:
            raise SpecError(
                f"no noise twin for control {job.name!r}: its local batch "
                f"({local}) is odd and its FSDP degree ({layout.dp_shard}) cannot "
                "be halved",
                key="regime",
                fix='use an even local_batch_size on the control, or regime = "seed"',
            )
        self.preflight(twin)
        if self.tokens_per_step(twin) != self.tokens_per_step(job):
            raise SpecError(
                f"the twin of {job.name!r} would read other tokens per step",
                key="regime",
                fix='use regime = "seed" for this control',
            )
        return twin

    def forward_twin(self, job: JobSpec, *, tp: int = 2) -> JobSpec | None:
        """The job with its row-wise linears' outputs (wo, w2) and its column-wise linears'
        input gradients (wq/wk/wv, w1/w3, output) summed in ``tp`` rounded slices as TP's ranks
        sum them (convergence/trainer/forward_noise.py); same layout, samples and seed."""
        if job.techniques.param_dtype == "float32":
            # An fp32 forward re-rounds at 6e-8: the relative floor covers it, no job needed.
            return None
        amplitude = UNIT_ROUNDOFF[job.techniques.param_dtype]
        overrides = (*job.overrides, ("training.forward_noise", repr(amplitude)))
        if tp > 2:  # TP2 is the trainer's default: its twin (and cache key) stays as it was
            overrides = (*overrides, ("training.forward_noise_tp", str(tp)))
        twin = dataclasses.replace(
            job,
            name=f"{job.name}-fwd-twin" + (f"-tp{tp}" if tp > 2 else ""),
            overrides=overrides,
        )
        self.preflight(twin)
        return twin

    def config_text(self, job: JobSpec) -> str:
        text = Path(job.train_config).read_text(encoding="utf-8")
        # The cache key covers torch, not torchao: a job that runs torchao's recipes keys
        # its release too, so an upgrade never reuses a float8 run of the old one.
        version = torchao_version() if precision_enabled(self.effective_config(job)) else None
        return text if version is None else f"{text}\n# torchao {version}\n"

    def seed_identity(self, job: JobSpec) -> dict[str, Any] | None:
        cfg = self.effective_config(job)
        # The weights depend only on the model shape, the init and the seed: every layout of
        # the same model and seed shares one seed checkpoint.
        return {
            "backend": self.version(),
            "model": cfg.to_dict()["model"],
            "seed": cfg.training.seed,
            "max_seq_len": cfg.data.seq_len,
        }

    def seed_entry(self, job: JobSpec, seed_dir: Path) -> list[str]:
        return [
            "-m",
            TRAINER_MODULE,
            "--config",
            str(job.train_config),
            *job_overrides(job),
            "--checkpoint.create_seed_checkpoint=true",
            f"--checkpoint.seed_checkpoint={seed_dir}",
            f"--metrics.dump_folder={seed_dir}/creator",
        ]

    def train_entry(self, job: JobSpec, dump_dir: Path, seed_dir: Path | None) -> list[str]:
        entry = [
            "-m",
            TRAINER_MODULE,
            "--config",
            str(job.train_config),
            *job_overrides(job),
            f"--metrics.dump_folder={dump_dir}",
        ]
        if seed_dir is not None:
            entry.append(f"--checkpoint.seed_checkpoint={seed_dir}")
        return entry + probe_flags(job)

    def launches_itself(self, job: JobSpec) -> bool:
        return False

    def metrics_path(self, job: JobSpec, dump_dir: Path) -> Path | None:
        return DumpDir(dump_dir).metrics

    def metrics_format(self, job: JobSpec) -> str:
        return "jsonl"

    def stop_file(self, job: JobSpec, dump_dir: Path) -> Path | None:
        return DumpDir(dump_dir).stop

    def record_keys(self, job: JobSpec) -> dict[str, str] | None:
        return None

    def read_metrics(self, job: JobSpec, dump_dir: Path) -> RunMetrics:
        # The JSONL holds exact float64 reprs; TensorBoard carries the same values for users.

        return read_jsonl(DumpDir(dump_dir).metrics)

    def read_meta(self, job: JobSpec, dump_dir: Path) -> dict[str, Any]:
        path = DumpDir(dump_dir).run_meta
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

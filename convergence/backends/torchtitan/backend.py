"""The torchtitan Backend: validation, the seed and train entries, the noise twin, metrics."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any

from convergence.backends.base import Capabilities, CodeIdentity
from convergence.backends.effective import once_per_job
from convergence.backends.torchtitan.argv import (
    LAUNCH_MODULE,
    OPTION_KEYS,
    PLACEHOLDER_DIR,
    TB_TAGS,
    backend_options,
    build_argv,
    launch_options,
    load_args,
    module_and_config,
    seed_args,
)
from convergence.backends.torchtitan.assets import (
    ASSETS_VERSION,
    assets_root,
    ensure_assets,
    entropy_floor,
)
from convergence.backends.torchtitan.config_parser import ParseError, blame, parse
from convergence.backends.torchtitan.converters import refusal
from convergence.backends.torchtitan.degrees import check_degrees
from convergence.backends.torchtitan.patches import unsupported_releases
from convergence.backends.torchtitan.resume import check_resume_layout
from convergence.cache.key import sources_hash
from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import read_jsonl
from convergence.metrics.tags import TENSORBOARD_TAGS
from convergence.metrics.tensorboard import read_tensorboard
from convergence.rank.hooks import find_hook_module
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.pp_schedules import MULTI_STAGE_SCHEDULES
from convergence.spec.run_dir import DumpDir
from convergence.spec.trainer_request import TrainerRequest
from convergence.torch_info import may_see_gpus
from convergence.torchao_info import INSTALL, torchao_installed


def source_dir() -> Path:
    """The folder ``import torchtitan`` loads (installed package or source checkout)."""
    spec = importlib.util.find_spec("torchtitan")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ImportError("torchtitan is not installed")
    return Path(locations[0]).resolve()


@functools.cache
def source_hash() -> str:
    """sha256 over torchtitan's ``.py`` files (once per process: ~0.1 s)."""
    return sources_hash(source_dir())


# -- the backend --------------------------------------------------------------------------------


class TorchtitanBackend:
    name = "torchtitan"
    # probe: the launcher wrapper runs the numerics probe inside torchtitan's own loop
    # (probe.py); resume and anchors: torchtitan's own DCP checkpointing (resume.py,
    # anchors.py), whose dataloader cannot change its DP degree at a load.
    capabilities = Capabilities(
        resume=True,
        anchors=True,
        anchors_keep_dp=True,
        twins_by_default=True,
        needs_train_config=False,
        probe=True,
        seed_is_a_job=True,
        # torchtitan's imports, once per warm server rather than per rank (warm.py says when).
        warm_imports=("convergence.backends.torchtitan.warm",),
    )

    def code_identity(self, job: JobSpec) -> CodeIdentity:
        # torchtitan's source hash is in the key (version()); a torchtitan checkout being
        # bisected names it by its tree.
        return CodeIdentity(keyed=True, packages=("torchtitan",))

    def version(self) -> str:
        """torchtitan's version and a hash of its Python sources where they are imported from
        (site-packages, or a source checkout: an edit there is a new key, so a stale control
        is never reused)."""
        return f"torchtitan-{_dist_version('torchtitan')}+src.{source_hash()[:16]}"

    # validation
    def base_config(self, job: JobSpec) -> Any:
        """The parsed config before the job's own settings (for its default local batch)."""
        module, config = module_and_config(job)
        return parse(("--module", module, "--config", config))

    def local_batch_size(self, job: JobSpec) -> int:
        if job.local_batch_size is not None:
            return job.local_batch_size
        return int(self.base_config(job).training.local_batch_size)

    def argv(
        self, job: JobSpec, *, dump_dir: Path = PLACEHOLDER_DIR, extra: list[str] | None = None
    ) -> list[str]:
        """Everything after ``-m torchtitan.train``."""
        return build_argv(
            job,
            dump_dir=dump_dir,
            extra=list(extra or []),
            local_batch_size=self.local_batch_size(job),
        )

    @once_per_job  # preflight, tokens per step, the twin: one parse (backends/effective.py)
    def effective_config(self, job: JobSpec) -> Any:
        return parse(tuple(self.argv(job, extra=load_args(PLACEHOLDER_DIR))))

    def _precision_preflight(self, job: JobSpec) -> None:
        """float8 / MXFP8 go to torchtitan's own converters (converters.py): a combination
        torchtitan 0.3.0 cannot train here is a skip with the reason (another device may run
        it), all-gather an error of the file (no device runs it)."""
        t = job.techniques
        if t.float8_all_gather:
            raise SpecError(
                "torchtitan 0.3.0's float8 converter has no float8 all-gather",
                file=job.source,
                key="techniques.float8_all_gather",
                fix='remove it, or run the pair on the built-in trainer (backend = "builtin")',
            )
        if not torchao_installed():
            raise NotRunnableHere(
                "float8 / MXFP8 need torchao, which is not installed in this environment",
                key="techniques",
                fix=INSTALL,
            )
        gpu = may_see_gpus() and _cuda_available()
        why = refusal(float8=t.float8, mxfp8=t.mxfp8, cpu=not gpu)
        if why is not None:
            raise NotRunnableHere(why, key="techniques", fix="run it where the recipe runs")

    def preflight(self, job: JobSpec) -> None:
        file = job.source
        refusal = unsupported_releases()
        if refusal is not None:  # not the file's fault: this session has other releases
            raise NotRunnableHere(
                refusal,
                key="backend",
                fix="install torchtitan 0.3.x with torch 2.13.x, or port "
                "convergence/backends/torchtitan/patches.py",
            )
        if job.techniques.numerics_changed:
            self._precision_preflight(job)
        for key in backend_options(job):
            if key not in OPTION_KEYS:
                raise SpecError(
                    "unknown torchtitan backend option",
                    file=file,
                    key=f"backend_options.{key}",
                    fix=f"use one of {', '.join(OPTION_KEYS)}",
                )
        if job.hook:
            if job.hook_mode != "after":
                raise SpecError(
                    f"hook_mode {job.hook_mode!r} is not available for torchtitan "
                    "jobs: torchtitan applies its own TP plan, and the hook runs "
                    "after torchtitan's parallelisation of each model part",
                    file=file,
                    key="hook_mode",
                    fix='use hook_mode = "after" (the default), or the built-in '
                    'backend for "replace_tp"',
                )
            find_hook_module(job.hook, file=file, key="hook")
        try:
            self.base_config(job)  # module/config alone first: its error names that option
            self.effective_config(job)
        except ParseError as exc:
            raise SpecError(
                f"torchtitan rejects the job's configuration:\n{exc.text}",
                file=file,
                key=blame(job, exc.text),
                fix="fix the override (see torchtitan's message above; "
                "`python -m torchtitan.config.manager --module M --config C "
                "--help` lists every key)",
            ) from None
        layout = job.layout
        if layout.pp > 1 and self.local_batch_size(job) % layout.microbatches:
            raise SpecError(
                f"local batch {self.local_batch_size(job)} does not split into "
                f"{layout.microbatches} pipeline microbatches",
                file=file,
                key="local_batch_size",
                fix="make local_batch_size a multiple of parallelism.pp_microbatches",
            )
        if layout.pp_stages_per_rank is not None and layout.pp_stages_per_rank != (
            2 if layout.pp_schedule in MULTI_STAGE_SCHEDULES else 1
        ):
            raise SpecError(
                "parallelism.pp_stages_per_rank is not passed on to torchtitan (it derives the "
                "stages per rank from the schedule: 1, or 2 for looped schedules)",
                file=file,
                key="parallelism.pp_stages_per_rank",
                fix="drop pp_stages_per_rank, or set torchtitan's own "
                'overrides."parallelism.pipeline_parallel_layers_per_stage"',
            )
        check_degrees(job, self.effective_config(job))
        check_resume_layout(job)

    def noise_twin(self, control: JobSpec) -> JobSpec:
        """The control's twin for the twin regime (convergence/stats/twin_envelope.py): the same seed
        checkpoint, samples, precision and techniques, reduced in another order.

        Half the local batch with twice the gradient accumulation (``training.global_batch_size``
        unchanged), on the same ranks. Not twice the data-parallel degree as for the built-in
        trainer: torchtitan's dataloader gives each data-parallel rank a contiguous chunk of the
        dataset (``split_dataset_by_node``), so another DP degree reads other samples, and the
        twin would measure batch noise instead of rounding."""

        local = self.local_batch_size(control)
        layout, tech = control.layout, control.techniques
        if local % 2 or (layout.pp > 1 and (local // 2) % layout.microbatches):
            raise SpecError(
                f"no noise twin for control {control.name!r}: its local batch ({local}) cannot "
                "be halved" + (" into whole pipeline microbatches" if layout.pp > 1 else ""),
                key="regime",
                fix='use an even local_batch_size on the control, or regime = "seed"',
            )
        twin = dataclasses.replace(
            control,
            name=f"{control.name}-twin",
            local_batch_size=local // 2,
            techniques=dataclasses.replace(tech, grad_accum_steps=tech.grad_accum_steps * 2),
        )
        self.preflight(twin)
        if self.tokens_per_step(twin) != self.tokens_per_step(control):
            raise SpecError(
                f"the twin of {control.name!r} would read other tokens per step",
                key="regime",
                fix='use regime = "seed" for this control',
            )
        return twin

    def forward_twin(self, control: JobSpec, *, tp: int = 2) -> JobSpec | None:
        """None: torchtitan has no setting that perturbs its forward at the rounding level, so
        its envelope is measured on the noise twin alone. A torchtitan build with such a knob
        (model hooks multiplying the row-wise linears' outputs by 1 + u*xi and summing the
        column-wise linears' input gradients in two rounded halves, as
        convergence/trainer/forward_noise.py does) would return the control with it set here."""
        return None

    def tokens_per_step(self, job: JobSpec) -> int:
        training = self.effective_config(job).training
        per_step = int(training.global_batch_size)
        if per_step <= 0:  # torchtitan's default: local batch x DP degree
            per_step = int(training.local_batch_size) * job.layout.dp
        return per_step * int(training.seq_len)

    def config_text(self, job: JobSpec) -> str:
        module, config = module_and_config(job)
        path = Path(job.train_config)
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        return json.dumps(
            {
                "module": module,
                "config": config,
                "train_config": text,
                "options": sorted(backend_options(job).items()),
                "assets": ASSETS_VERSION,
            }
        )

    # seed checkpoint
    def seed_identity(self, job: JobSpec) -> dict[str, Any] | None:
        module, config = module_and_config(job)
        # Weights depend on the model (module + config), the init and the seed only.
        return {"backend": self.version(), "module": module, "config": config, "seed": job.seed}

    def seed_entry(self, job: JobSpec, seed_dir: Path) -> list[str]:
        ensure_assets(assets_root(job))
        single = _one_process(job)
        # A rank's entry (capabilities.seed_is_a_job): torchtitan reads WORLD_SIZE and wants a
        # process group, so the launcher starts it as a one-rank job -- forked from the warm
        # server with torchtitan imported (a torchrun of its own spawned a fresh rank that
        # imported torch, torchao and torchtitan again: ~7 CPU s per session).
        return [
            "-m",
            LAUNCH_MODULE,
            *build_argv(
                single,
                dump_dir=seed_dir / "creator",
                extra=seed_args(seed_dir),
                local_batch_size=None,
            ),
        ]

    def train_entry(self, job: JobSpec, dump_dir: Path, seed_dir: Path | None) -> list[str]:
        ensure_assets(assets_root(job))
        extra = load_args(seed_dir) if seed_dir is not None else []
        return [
            "-m",
            LAUNCH_MODULE,
            *launch_options(job, dump_dir),
            *self.argv(job, dump_dir=dump_dir, extra=extra),
        ]

    def launches_itself(self, job: JobSpec) -> bool:
        return False

    # metrics
    def metrics_path(self, job: JobSpec, dump_dir: Path) -> Path | None:
        # Tailed while the job runs (convergence.metrics.tb_tail).
        return DumpDir(dump_dir).tensorboard

    def metrics_format(self, job: JobSpec) -> str:
        return "tensorboard"

    def stop_file(self, job: JobSpec, dump_dir: Path) -> Path | None:
        return None  # torchtitan has no stop request: an early stop ends the job

    def record_keys(self, job: JobSpec) -> dict[str, str] | None:
        # Live records carry torchtitan's tags and our norms (first: they name grad_norm and
        # grad_norm_parts, so torchtitan's float32 "grad_norm" is not what is judged).
        return {**TB_TAGS, **TENSORBOARD_TAGS}

    def read_metrics(self, job: JobSpec, dump_dir: Path) -> RunMetrics:
        metrics = read_tensorboard(DumpDir(dump_dir).tensorboard)
        steps = DumpDir(dump_dir).step_log
        if steps.is_file():  # the wrapper's records, at full precision: they win
            metrics.update(read_jsonl(steps))
        return metrics

    def read_meta(self, job: JobSpec, dump_dir: Path) -> dict[str, Any]:
        if "dataset_path" in backend_options(job):  # the user's data: its floor is unknown
            return {}
        return {"entropy_floor": entropy_floor()}  # the generated corpus (assets.py)


def _one_process(job: JobSpec) -> JobSpec:
    """The job on a single rank (seed checkpoint): no parallelism, no techniques, and not a
    resuming side's phase nor a part of the anchored check (their checkpoint words would
    replace the seed folder)."""

    return dataclasses.replace(
        job,
        layout=ParallelLayout(),
        techniques=Techniques(),
        steps=1,
        request=TrainerRequest(),
    )


def _cuda_available() -> bool:
    """torch sees a GPU (asked only where :func:`may_see_gpus` cannot rule it out)."""
    import torch

    return bool(torch.cuda.is_available())

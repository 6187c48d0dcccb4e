"""A job as torchtitan's command line: ``--module M --config C`` + the words that realise the
job's layout, techniques and settings + the user's overrides, in the form tyro takes
(booleans as ``--a.b`` / ``--a.no-b`` flags, the activation checkpoint mode as a subcommand
after every other option)."""

from __future__ import annotations

from pathlib import Path

from convergence.backends.torchtitan import anchors, resume
from convergence.backends.torchtitan.assets import asset_paths
from convergence.spec.job import JobSpec
from convergence.spec.run_dir import DumpDir

DEFAULT_MODULE = "llama3"
DEFAULT_CONFIG = "llama3_debugmodel"
DEFAULT_DATASET = "c4_test"
OPTION_KEYS = ("module", "config", "hf_assets_path", "dataset", "dataset_path", "assets_dir")
TRAIN_MODULE = "torchtitan.train"
#: The entry point every job runs: torchtitan.train behind our wrapper (CPU workarounds,
#: torch 2.13 fixes, hooks, per-step records; convergence/backends/torchtitan/launch.py).
LAUNCH_MODULE = "convergence.backends.torchtitan.launch"
#: The wrapper's float64 norms as TensorBoard tags beside torchtitan's own -> our metric names.
TB_TAGS = {
    "convergence/grad_norm": "grad_norm",
    "convergence/grad_norm_parts": "grad_norm_parts",
    "convergence/update_norm_parts": "update_norm_parts",
}
SEED_FOLDER = "checkpoint"
#: Where a seed checkpoint lands inside the seed folder (``save(curr_step=0)``).
SEED_STEP = "step-0"
#: A stand-in for folders that do not exist yet when validating (absolute: torchtitan checks).
PLACEHOLDER_DIR = Path("/nonexistent/convergence-preflight")
AC_SUBCOMMANDS = {
    "none": "activation-checkpoint:none",
    "full": "activation-checkpoint:full",
    "selective": "activation-checkpoint:selective",
}


def backend_options(job: JobSpec) -> dict[str, str]:
    return dict(job.backend_options)


def module_and_config(job: JobSpec) -> tuple[str, str]:
    options = backend_options(job)
    return options.get("module", DEFAULT_MODULE), options.get("config", DEFAULT_CONFIG)


def flag(key: str, value: bool) -> str:
    """tyro's boolean flags: ``--a.b`` / ``--a.no-b`` (``--a.b=true`` is rejected)."""
    head, _, leaf = key.rpartition(".")
    if value:
        return f"--{key}"
    return f"--{head}.no-{leaf}" if head else f"--no-{leaf}"


def override_arg(key: str, value: str) -> str:
    """A user override as an argv word: TOML booleans become tyro flags."""
    key = key.lstrip("-")
    if value in ("true", "false"):
        return flag(key, value == "true")
    return f"--{key}={value}"


def _is_ac_key(key: str) -> bool:
    return key.lstrip("-").replace("-", "_").startswith("activation_checkpoint.")


def job_overrides(job: JobSpec, local_batch_size: int | None) -> list[str]:
    """The ``--section.key`` words that realise the job's layout, techniques and settings
    (``local_batch_size``: the effective one, needed for the PP microbatch size)."""
    layout, tech = job.layout, job.techniques
    words = [
        f"--training.steps={job.steps}",
        f"--debug.seed={job.seed}",
        flag("debug.deterministic", tech.deterministic),
        f"--parallelism.data_parallel_replicate_degree={layout.dp_replicate}",
        f"--parallelism.data_parallel_shard_degree={layout.dp_shard}",
        f"--parallelism.tensor_parallel_degree={layout.tp}",
        flag("parallelism.enable_sequence_parallel", layout.sequence_parallel),
        f"--parallelism.pipeline_parallel_degree={layout.pp}",
        f"--parallelism.pipeline_parallel_schedule={layout.pp_schedule}",
        f"--parallelism.context_parallel_degree={layout.cp}",
        # torchtitan 0.3.0's default "spmd_types" leaves plain tensors that torch 2.13's
        # fully_shard refuses (on any device); "partial_dtensor": DTensor on the
        # model-parallel axes only, FSDP2 as usual.
        "--parallelism.spmd_backend=partial_dtensor",
        # torchtitan's "default" is ZeRO-3 with its own smart exceptions; False means ZeRO-2.
        "--parallelism.fsdp_reshard_after_forward="
        + ("default" if tech.reshard_after_forward else "never"),
        f"--training.mixed_precision_param={tech.param_dtype}",
        f"--training.mixed_precision_reduce={tech.reduce_dtype}",
        flag("training.enable_cpu_offload", tech.cpu_offload),
        flag("compile.enable", tech.compile),
        flag("metrics.enable_tensorboard", True),
        "--metrics.log_freq=1",
    ]
    if layout.ep > 1:
        # EP borrows its ranks from dp_shard x cp, in torchtitan as in the built-in trainer.
        # Only when set: a dense job's command line (and its cache key) stays as it was.
        words.append(f"--parallelism.expert_parallel_degree={layout.ep}")
    if layout.pp > 1 or layout.ep > 1:
        # torchtitan 0.3.0 captures CUDA graphs by default and refuses them with PP, and with
        # EP's all-to-all token dispatcher (it reads the split sizes on the host).
        words.append(flag("training.disable_cuda_graphs", True))
    if job.local_batch_size is not None:
        words.append(f"--training.local_batch_size={job.local_batch_size}")
    if local_batch_size is not None:
        if layout.pp > 1:
            # torchtitan splits the local batch into microbatches of this size.
            words.append(
                "--parallelism.pipeline_parallel_microbatch_size="
                f"{max(1, local_batch_size // layout.microbatches)}"
            )
        if tech.grad_accum_steps > 1:
            words.append(
                "--training.global_batch_size="
                f"{local_batch_size * layout.dp * tech.grad_accum_steps}"
            )
    return words


def build_argv(
    job: JobSpec, *, dump_dir: Path, extra: list[str], local_batch_size: int | None
) -> list[str]:
    """``--module M --config C`` + spec-derived words + ``extra`` + user overrides, with the
    activation checkpoint subcommand (and its own options) last, as tyro requires."""
    module, config = module_and_config(job)
    options = backend_options(job)
    hf_assets, dataset_path = asset_paths(job)
    user = [(k, v) for k, v in job.overrides if not _is_ac_key(k)]
    user_ac = [(k, v) for k, v in job.overrides if _is_ac_key(k)]
    return [
        "--module",
        module,
        "--config",
        config,
        f"--hf_assets_path={hf_assets}",
        f"--dataloader.dataset={options.get('dataset', DEFAULT_DATASET)}",
        f"--dataloader.dataset_path={dataset_path}",
        f"--dump_folder={dump_dir}",
        *job_overrides(job, local_batch_size),
        *extra,
        # User overrides come after the spec-derived words so they win.
        *(override_arg(k, v) for k, v in user),
        # What the library asks of the trainer (JobSpec.request), in torchtitan's words.
        *resume.torchtitan_words(job.request),  # a resuming side's phase (resume.py)
        *anchors.torchtitan_words(job.request, dump_dir),  # the anchored check (anchors.py)
        *([flag("metrics.enable_tensorboard", False)] if job.request.probe_step else []),
        AC_SUBCOMMANDS[job.techniques.activation_checkpoint],
        *(override_arg(k, v) for k, v in user_ac),
    ]


def launch_options(job: JobSpec, dump_dir: Path) -> list[str]:
    """The wrapper's own words (convergence/backends/torchtitan/launch.py): its per-step
    records, the user's hook, a resuming side's phase, the anchored check's part, the probe."""
    words = [f"--convergence.log={DumpDir(dump_dir).step_log}"]
    words += resume.launch_words(job.request)
    words += anchors.launch_words(job.request)
    if job.request.probe_step:
        words.append(f"--convergence.probe_step={job.request.probe_step}")
    if job.hook:
        words += [f"--convergence.hook={job.hook}", f"--convergence.hook_mode={job.hook_mode}"]
    if job.techniques.float8 != "none":  # torchtitan's own converters (converters.py)
        words.append(f"--convergence.float8={job.techniques.float8}")
    if job.techniques.mxfp8:
        words.append("--convergence.mxfp8")
    return words


def seed_args(seed_dir: Path) -> list[str]:
    return [
        flag("checkpoint.enable", True),
        flag("checkpoint.create_seed_checkpoint", True),
        f"--checkpoint.folder={seed_dir / SEED_FOLDER}",
        flag("checkpoint.last_save_model_only", True),
    ]


def load_args(seed_dir: Path) -> list[str]:
    return [
        flag("checkpoint.enable", True),
        flag("checkpoint.load_only", True),
        f"--checkpoint.initial_load_path={seed_dir / SEED_FOLDER / SEED_STEP}",
        flag("checkpoint.initial_load_model_only", True),
    ]

"""torchtitan (pinned 0.3.0, the ``torchtitan`` extra) as a backend.

A job becomes ``torchrun ... -m torchtitan.train --module M --config C [overrides]``. In 0.3.0
a config is a Python function in a model's ``config_registry`` (``llama3`` /
``llama3_debugmodel``), parsed by ``torchtitan.config.ConfigManager`` with tyro; overrides are
``--section.key=value``, booleans are flags (``--debug.deterministic`` /
``--debug.no-deterministic``) and the activation checkpoint mode is a tyro subcommand
(``activation-checkpoint:none``) that must come after every other option.

    [defaults]
    backend = "torchtitan"
    train_config = "debug_1gpu.toml"     # hashed into the run-cache key, not parsed
    backend_options = { module = "llama3", config = "llama3_debugmodel" }
    overrides = { "training.seq_len" = 256 }

``backend_options``: ``module``, ``config``, ``hf_assets_path`` and ``dataset_path`` (default: a
tiny word-level tokenizer and a synthetic corpus generated once under ``assets_dir``, because
the wheel ships neither torchtitan's ``tests/assets`` tokenizer nor its c4_test data),
``dataset`` (a torchtitan dataset name, default ``c4_test``: a local JSON-lines loader),
``assets_dir``.

Seed checkpoint, the torchtitan way: one process (``torchrun --nproc-per-node 1``) with
``--checkpoint.enable --checkpoint.create_seed_checkpoint`` writes ``<seed>/checkpoint/step-0``;
every layout loads it with ``--checkpoint.initial_load_path`` (model only) and
``--checkpoint.load_only`` (no saves).

Metrics: TensorBoard under ``<dump>/tb/<timestamp>/`` (torchtitan's tags; with PP the last
stage's rank logs the loss; the learning rate as ``lr/<optimizer class>``), read at the
precision torchtitan writes them (float32 ``add_scalar``).

Live metrics: the TensorBoard folder is tailed while the job runs (convergence.metrics.tb_tail:
torchtitan's writer appends each step's scalars to the event file as they come, despite its
``flush_secs=120``), so a torchtitan job shows progress with an ETA, is stopped at a NaN loss
or when the sequential test has decided (no stop request exists in torchtitan: the job's
processes are ended), and is idle-limited from its first step on. The console line is not
used: it prints the loss with 5 decimals, coarser than the paired tolerance (~1e-5).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import random
import re
import shutil
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any

from convergence.backends.base import Capabilities, CodeIdentity
from convergence.backends.effective import once_per_job
from convergence.cache.key import sources_hash
from convergence.metrics.curve import RunMetrics
from convergence.metrics.jsonl import read_jsonl
from convergence.metrics.tags import TENSORBOARD_TAGS
from convergence.metrics.tensorboard import read_tensorboard
from convergence.spec.errors import SpecError
from convergence.spec.job import JobSpec
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.pp_schedules import MULTI_STAGE_SCHEDULES

if importlib.util.find_spec("torchtitan") is None:  # get_backend turns this into a SpecError
    raise ImportError("torchtitan is not installed")

DEFAULT_MODULE = "llama3"
DEFAULT_CONFIG = "llama3_debugmodel"
DEFAULT_DATASET = "c4_test"
OPTION_KEYS = ("module", "config", "hf_assets_path", "dataset", "dataset_path", "assets_dir")
TRAIN_MODULE = "torchtitan.train"
#: The entry point every job runs: torchtitan.train behind our wrapper (CPU workarounds,
#: torch 2.13 fixes, hooks, per-step records; convergence/backends/torchtitan_launch.py).
LAUNCH_MODULE = "convergence.backends.torchtitan_launch"
#: Per-step records of the wrapper (data fingerprint, per-part grad norms), rank 0.
STEP_LOG = "convergence_steps.jsonl"
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
ASSETS_VERSION = "v1"


# -- options and argv -------------------------------------------------------------------------


def _options(job: JobSpec) -> dict[str, str]:
    return dict(job.backend_options)


def module_and_config(job: JobSpec) -> tuple[str, str]:
    options = _options(job)
    return options.get("module", DEFAULT_MODULE), options.get("config", DEFAULT_CONFIG)


def assets_root(job: JobSpec) -> Path:
    """Generated tokenizer/corpus folder (shared by every job; absolute)."""
    explicit = _options(job).get("assets_dir")
    if explicit:
        return Path(explicit).expanduser().resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "pytest-convergence" / f"torchtitan-assets-{ASSETS_VERSION}"


def asset_paths(job: JobSpec) -> tuple[str, str]:
    """(hf_assets_path, dataset_path) the job trains with."""
    options = _options(job)
    root = assets_root(job)
    return (
        options.get("hf_assets_path", str(root / "tokenizer")),
        options.get("dataset_path", str(root / "corpus")),
    )


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
    if job.local_batch_size is not None:
        words.append(f"--training.local_batch_size={job.local_batch_size}")
    if local_batch_size is not None:
        if layout.pp > 1:
            # torchtitan 0.3.0 captures CUDA graphs by default and refuses them with PP.
            words.append(flag("training.disable_cuda_graphs", True))
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
    options = _options(job)
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
        AC_SUBCOMMANDS[job.techniques.activation_checkpoint],
        *(override_arg(k, v) for k, v in user_ac),
    ]


def launch_options(job: JobSpec, dump_dir: Path) -> list[str]:
    """The wrapper's own words (convergence/backends/torchtitan_launch.py): its per-step
    records and the user's hook."""
    words = [f"--convergence.log={dump_dir / STEP_LOG}"]
    if job.hook:
        words += [f"--convergence.hook={job.hook}", f"--convergence.hook_mode={job.hook_mode}"]
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


# -- torchtitan's own parser (imported lazily, once per process) -----------------------------


@functools.cache
def _config_manager() -> Any:
    from torchtitan.config import ConfigManager  # seconds: torchtitan, tyro, the models

    return ConfigManager()


class ParseError(Exception):
    """torchtitan's config parser refused an argv; ``text`` is its message, cleaned."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(text)


_NOISE = re.compile(r"^[\s│╭╰─┌└┐┘|+-]*$")


def _clean(text: str) -> str:
    """tyro's boxed help output -> the lines that say what is wrong."""
    keep = []
    for raw in text.splitlines():
        line = raw.strip().strip("│").strip()
        if (
            _NOISE.match(line)
            or line.startswith(("For full helptext", "in /"))
            or "has no effect without" in line
            or "does not exist!" in line
        ):
            continue
        keep.append(re.sub(r"\s+", " ", line))
    return "\n".join(keep) or "invalid arguments"


@functools.lru_cache(maxsize=256)
def parse(argv: tuple[str, ...]) -> Any:
    """torchtitan's config for ``argv`` (after ``-m torchtitan.train``); raises ParseError.

    Runs on CPU, without a process group. tyro reports an error by printing it and exiting:
    both are captured here."""
    manager = _config_manager()
    sink = io.StringIO()
    try:
        with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            return manager.parse_args(list(argv))
    except SystemExit:
        raise ParseError(_clean(sink.getvalue())) from None
    except Exception as exc:  # noqa: BLE001 - torchtitan's own checks (lookup, __post_init__)
        raise ParseError(f"{type(exc).__name__}: {exc}") from None


# -- synthetic assets ---------------------------------------------------------------------------

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
NUM_WORDS = 1000  # + specials, below the debug model's 2048-token vocabulary


def _words() -> list[str]:
    rng = random.Random(7)
    letters = "etaoinshrdlucmfwypvbgk"
    words: set[str] = set()
    while len(words) < NUM_WORDS:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))))
    return sorted(words)


def _corpus(words: list[str], *, num_docs: int = 2000) -> list[str]:
    """A first-order Markov chain over the words: each word has a few likely successors, so a
    model has something to learn and the loss keeps falling for hundreds of steps."""
    rng = random.Random(11)
    successors = {w: rng.sample(words, 6) for w in words}
    docs = []
    for _ in range(num_docs):
        word = rng.choice(words)
        out = [word]
        for _ in range(rng.randint(150, 450)):
            word = rng.choice(successors[word]) if rng.random() < 0.9 else rng.choice(words)
            out.append(word)
        docs.append(" ".join(out))
    return docs


def ensure_assets(root: Path) -> Path:
    """Create (once, atomically) ``root/tokenizer`` and ``root/corpus``."""
    if (root / "DONE").is_file():
        return root
    from tokenizers import Tokenizer, models, pre_tokenizers  # a torchtitan dependency

    words = _words()
    build = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    (build / "tokenizer").mkdir(parents=True)
    (build / "corpus").mkdir()
    vocab = {tok: i for i, tok in enumerate([UNK, BOS, EOS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(build / "tokenizer" / "tokenizer.json"))
    (build / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": UNK,
                "add_bos_token": True,
                "add_eos_token": True,
            }
        )
    )
    with (build / "corpus" / "data.jsonl").open("w") as fh:
        for doc in _corpus(words):
            fh.write(json.dumps({"text": doc}) + "\n")
    (build / "DONE").write_text(ASSETS_VERSION)
    try:
        build.rename(root)
    except OSError:  # another process won the race: theirs is identical
        shutil.rmtree(build, ignore_errors=True)
    return root


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
    capabilities = Capabilities(twins_by_default=True, needs_train_config=False)

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

    def preflight(self, job: JobSpec) -> None:
        file = job.source
        for key in _options(job):
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
            from convergence.trainer.hooks import find_hook_module  # lazy: torch

            find_hook_module(job.hook, file=file, key="hook")
        try:
            self.base_config(job)  # module/config alone first: its error names that option
            self.effective_config(job)
        except ParseError as exc:
            raise SpecError(
                f"torchtitan rejects the job's configuration:\n{exc.text}",
                file=file,
                key=_blame(job, exc.text),
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

    def noise_twin(self, control: JobSpec) -> JobSpec:
        """The control's twin for the twin regime (convergence/stats/twin.py): the same seed
        checkpoint, samples, precision and techniques, reduced in another order.

        Half the local batch with twice the gradient accumulation (``training.global_batch_size``
        unchanged), on the same ranks. Not twice the data-parallel degree as for the built-in
        trainer: torchtitan's dataloader gives each data-parallel rank a contiguous chunk of the
        dataset (``split_dataset_by_node``), so another DP degree reads other samples, and the
        twin would measure batch noise instead of rounding."""
        import dataclasses

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

    def forward_twin(self, control: JobSpec) -> JobSpec | None:
        """None: torchtitan has no setting that perturbs its forward at the rounding level, so
        its envelope is measured on the noise twin alone. A torchtitan build with such a knob
        (a model hook multiplying linear outputs by 1 + u*xi, as
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
                "options": sorted(_options(job).items()),
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
        # One process through torchrun: torchtitan reads WORLD_SIZE and wants a process group.
        return [
            "-m",
            "convergence.launch.loopback_torchrun",
            "--standalone",
            "--nproc-per-node=1",
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
        return dump_dir / "tb"  # tailed while the job runs (convergence.metrics.tb_tail)

    def metrics_format(self, job: JobSpec) -> str:
        return "tensorboard"

    def stop_file(self, job: JobSpec, dump_dir: Path) -> Path | None:
        return None  # torchtitan has no stop request: an early stop ends the job

    def record_keys(self, job: JobSpec) -> dict[str, str] | None:
        return dict(TENSORBOARD_TAGS)  # live records carry torchtitan's tags

    def read_metrics(self, job: JobSpec, dump_dir: Path) -> RunMetrics:
        metrics = read_tensorboard(dump_dir / "tb")
        steps = dump_dir / STEP_LOG
        if steps.is_file():  # the wrapper's records (absent in runs cached before it existed)
            for name, curve in read_jsonl(steps).items():
                metrics.setdefault(name, curve)
        return metrics

    def read_meta(self, job: JobSpec, dump_dir: Path) -> dict[str, Any]:
        return {}


def check_degrees(job: JobSpec, cfg: Any) -> None:
    """The parallel degrees against torchtitan's model arguments (attention heads, layers,
    sequence length), at collection instead of as a rank's traceback."""
    model = cfg.model_spec.model
    layout, file = job.layout, job.source
    attention = getattr(model, "first_attention", None)
    heads: int | None = getattr(attention, "n_heads", None)
    kv_heads: int | None = getattr(attention, "n_kv_heads", None) or heads
    if layout.tp > 1 and heads is not None and kv_heads is not None:
        for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
            if count % layout.tp:
                raise SpecError(
                    f"tp = {layout.tp} does not divide the model's {count} {what}",
                    file=file,
                    key="parallelism.tp",
                    fix=f"use a tp degree that divides {count}",
                )
    seq_len = int(cfg.training.seq_len)
    divisor = (layout.tp if cfg.parallelism.enable_sequence_parallel else 1) * (
        2 * layout.cp if layout.cp > 1 else 1
    )
    if seq_len % divisor:
        raise SpecError(
            f"training.seq_len {seq_len} is not a multiple of {divisor} (tp with "
            "sequence parallel x 2 x cp: torchtitan's load balancing)",
            file=file,
            key="overrides.training.seq_len",
            fix=f"use a seq_len divisible by {divisor}",
        )
    block = getattr(getattr(attention, "inner_attention", None), "block_size", None)
    if layout.cp > 1 and block is not None:  # flex attention: its CP block mask
        block = max(block) if isinstance(block, tuple) else int(block)
        if seq_len % (layout.cp * block):
            raise SpecError(
                f"training.seq_len {seq_len} is not a multiple of cp x the flex "
                f"attention block size ({layout.cp} x {block}): torch shards the "
                "block mask in whole blocks per CP rank",
                file=file,
                key="overrides.training.seq_len",
                fix=f"use a seq_len divisible by {layout.cp * block}",
            )
    layers = getattr(model, "layers", None)
    stages = layout.pp * (2 if layout.pp_schedule in MULTI_STAGE_SCHEDULES else 1)
    if layout.pp > 1 and layers is not None and len(layers) < stages:
        raise SpecError(
            f"{stages} pipeline stages for a model of {len(layers)} layers",
            file=file,
            key="parallelism.pp",
            fix="use fewer pipeline stages than the model has layers",
        )


def _one_process(job: JobSpec) -> JobSpec:
    """The job on a single rank (seed checkpoint): no parallelism, no techniques."""
    import dataclasses

    return dataclasses.replace(job, layout=ParallelLayout(), techniques=Techniques(), steps=1)


#: torchtitan settings derived from the spec -> the experiment key that set them.
SPEC_KEYS = {
    "mixed_precision_param": "techniques.param_dtype",
    "mixed_precision_reduce": "techniques.reduce_dtype",
    "pipeline_parallel_schedule": "parallelism.pp_schedule",
    "pipeline_parallel_microbatch_size": "parallelism.pp_microbatches",
    "local_batch_size": "local_batch_size",
    "context_parallel_degree": "parallelism.cp",
    "tensor_parallel_degree": "parallelism.tp",
    "pipeline_parallel_degree": "parallelism.pp",
}


def _blame(job: JobSpec, message: str) -> str:
    """The experiment key a parser message is about: a user override when it names one."""
    text = message.replace("-", "_")
    keys = [(key, key.lstrip("-").replace("-", "_")) for key, _ in job.overrides]
    for key, dotted in keys:  # the full ``section.key`` first, then the bare key name
        if dotted in text:
            return f"overrides.{key}"
    for key, dotted in keys:
        if re.search(rf"\b{re.escape(dotted.rsplit('.', 1)[-1])}\b", text):
            return f"overrides.{key}"
    for theirs, ours in SPEC_KEYS.items():  # a value the spec put there
        if theirs in text:
            return ours
    if "Config function" in message or "config_registry" in message:
        return (
            "backend_options.config" if "Config function" in message else "backend_options.module"
        )
    return "overrides" if job.overrides else "backend_options"

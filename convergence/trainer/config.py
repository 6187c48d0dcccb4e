"""The train config: TOML sections parsed once into frozen dataclasses, plus CLI overrides.

    torchrun ... -m convergence.trainer --config debug --training.steps=50

Section and key names follow torchtitan's JobConfig where one exists, so users can read both.
Every unknown section or key is an error naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from convergence.configs import shipped_config, shipped_configs
from convergence.spec.errors import SpecError
from convergence.spec.job import HookMode
from convergence.spec.layout import PP_DEFAULTED, ACMode, DType, Float8Recipe, Layout

# The closed choices of the train config (validate.check_config holds values to them; the
# parser reads them as strings, so its type error and check_config's choice list stay apart).
DataSource = Literal["synthetic", "text"]
Device = Literal["auto", "cpu", "cuda"]
DecayType = Literal["cosine", "linear", "none"]
OptimizerName = Literal["AdamW", "adamw"]
Kernels = Literal["auto", "emulated", "hardware"]
DATA_SOURCES: tuple[DataSource, ...] = get_args(DataSource)
DEVICES: tuple[Device, ...] = get_args(Device)
DECAY_TYPES: tuple[DecayType, ...] = get_args(DecayType)
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
KERNELS: tuple[Kernels, ...] = get_args(Kernels)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: Literal["llama"] = "llama"
    """Model family; only the built-in Llama-style decoder ("llama") for now."""
    vocab_size: int = 256
    """Vocabulary size (256 = bytes for the text source)."""
    dim: int = 64
    """Hidden size."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden_dim: int = 0
    """SwiGLU hidden size; 0 = 8/3*dim rounded up to multiple_of."""
    multiple_of: int = 32
    """Rounding of the default SwiGLU hidden size."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    init_std: float = 0.02
    """Std of the normal init of linear weights."""
    tie_embeddings: bool = False
    """Share the embedding and output weights."""
    block_pattern: str = ""
    """Comma-separated block kinds, repeated over the layers (e.g. "standard,single_sync,parallel");
    "" = all standard. See convergence.trainer.blocks (BLOCK_KINDS)."""
    parallel_groups: int = 2
    """"parallel" blocks: independent slices of the hidden state (block-diagonal weights); under
    TP each rank computes parallel_groups/tp of them with no communication."""
    n_experts: int = 0
    """Mixture of experts: routed experts per MoE layer; 0 = a dense model (every block's
    FFN is the SwiGLU above). See convergence.trainer.moe and docs/moe.md."""
    top_k: int = 2
    """MoE: experts each token is routed to."""
    score_func: str = "softmax"
    """MoE: router scores, "softmax" (over all experts) or "sigmoid" (each expert on its own,
    DeepSeek-V3)."""
    route_norm: bool = False
    """MoE: divide each token's top-k routing weights by their sum."""
    expert_hidden_dim: int = 0
    """MoE: SwiGLU hidden size of each expert; 0 = ffn_hidden_dim's default / top_k."""
    n_shared_experts: int = 0
    """MoE: shared experts every token goes through besides its routed ones (one SwiGLU of
    n_shared_experts * expert_hidden_dim); 0 = none."""
    n_dense_layers: int = 0
    """MoE: the first n_dense_layers blocks keep a dense FFN (DeepSeek's first_k_dense)."""
    aux_loss_coeff: float = 0.0
    """MoE: weight of the sequence-wise load-balancing loss added to the training objective
    (0 = off). Logged as moe_aux_loss (without the coefficient)."""
    bias_update_rate: float = 0.0
    """MoE: auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's
    routing bias moves by this much towards balance (sign of mean load - its load); 0 = off."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: DataSource = "synthetic"
    """"synthetic" (seeded Markov language with a known entropy floor) or "text" (a local file)."""
    path: str = ""
    """Text source: path of a local UTF-8 text file (relative to the config file's folder)."""
    tokenizer: str = "byte"
    """Text source: "byte" (vocab 256) or a path to a tokenizer.json file."""
    seq_len: int = 64
    """Tokens per sample (the model's context)."""
    seed: int = 1234
    """Seed of the synthetic language itself (its transition table), not the sample order."""
    synthetic_concentration: float = 0.05
    """Dirichlet concentration of each synthetic transition row: smaller = lower entropy floor."""
    val_fraction: float = 0.05
    """Text source: tail fraction held out for validation."""
    pad_fraction: float = 0.0
    """Synthetic source: fraction of samples cut at a random length, their remaining labels set to
    ignore_index (-100) as padding would; ranks then hold different numbers of valid tokens."""
    copy_span: int = 0
    """Synthetic source: the first `copy_span` tokens of every sample are uniform and its last
    `copy_span` tokens repeat them, at the fixed distance seq_len+1-copy_span: predictable only
    by attention to that exact earlier position. 0 = off; at most seq_len // 2. See
    convergence.trainer.data (exact entropy floor; what it was measured to catch)."""
    lag: int = 1
    """Synthetic source: token t is drawn from the transition row of token t-lag (lag
    interleaved Markov chains). 1 = a plain chain, which a bigram model learns without
    attention; 2 or more needs attention to an exact earlier position."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    steps: int = 100
    """Optimizer steps."""
    local_batch_size: int = 8
    """Samples per data-parallel rank per microstep (PP splits it into microbatches)."""
    grad_accum_steps: int = 1
    """Microsteps accumulated per optimizer step."""
    seed: int = 42
    """Seed of the weights (seed checkpoint) and of the sample order."""
    max_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    param_dtype: DType = "float32"
    """FSDP mixed precision: compute dtype of the unsharded parameters."""
    reduce_dtype: DType = "float32"
    """FSDP mixed precision: dtype of the gradient reduction."""
    compile: bool = False
    """torch.compile each block."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of params, grads and optimizer state."""
    deterministic: bool = True
    """Deterministic algorithms and seeded RNGs."""
    forward_noise: float = 0.0
    """Non-zero: this run is the forward-noise twin -- every split matmul of a tensor-parallel
    layout (row-wise wo/w2, column-wise wq/wk/wv, w1/w3, output) computed in rounded slices
    summed as TP's ranks sum them (0 = off). The built-in backend writes the compute dtype's
    unit roundoff here, the size of the rounding the twin adds. Only the twin regime's
    forward-noise twin sets it (Backend.forward_twin): see convergence/trainer/forward_noise.py."""
    forward_noise_tp: int = 2
    """With ``forward_noise``: the TP degree the twin rounds as (its slices per split matmul).
    The twin regime adds twins of degree 4, 8, ... for a test of a larger TP degree
    (convergence/regimes/twin.py ``forward_twin_degrees``)."""
    device: Device = "auto"
    """"auto" (cuda if available, else cpu), "cpu" or "cuda"."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    name: OptimizerName = "AdamW"
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class LRSchedulerConfig:
    warmup_steps: int = 10
    """Linear warmup from 0 over this many steps."""
    decay_type: DecayType = "cosine"
    """"cosine", "linear" or "none" after warmup."""
    min_lr_factor: float = 0.1
    """Final lr as a fraction of the peak."""


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig(Layout):
    """[parallelism]: the layout (spec/layout.py's Layout, the experiment spec's schema: its
    fields come first, in its order) and the trainer's own settings after them.

    An unset PP default is None here as in the spec; the TOML file and overrides may also
    spell it 0, and the records the trainer writes (run_meta.json, resume.json, probe.json)
    keep spelling it 0 (:meth:`to_dict`), so old files read the same and new records are
    byte for byte what they were."""

    reshard_after_forward: bool = True
    """FSDP: ZeRO-3 (True) or ZeRO-2-like (False)."""
    hook: str = ""
    """"package.module:function" applied to the model on every rank (see convergence.rank.hooks)."""
    hook_mode: HookMode = "after"
    """"after": call the hook after the built-in parallelisation; "replace_tp": the hook applies
    tensor parallelism in place of the built-in TP plan (FSDP, AC, PP still built in)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as the trainer's files spell them (an unset PP default: 0)."""
        out = dataclasses.asdict(self)
        for name in PP_DEFAULTED:
            if out[name] is None:
                out[name] = 0
        if out["ep"] == 1:  # only when set: records of runs without EP stay byte for byte
            del out["ep"]
        return out


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointConfig:
    mode: ACMode = "none"
    """"none", "full" (every block) or "selective" (every `selective_layer_freq`-th block)."""
    selective_layer_freq: int = 2


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """[precision]: low-precision linears through torchao (convergence.trainer.precision)."""

    float8: Float8Recipe = "none"
    """Float8 linears: "none", "tensorwise" (one scale per tensor) or "rowwise" (one per row)."""
    float8_all_gather: bool = False
    """FSDP2 all-gathers the weights in float8 (tensorwise only), their scales recomputed for
    all ranks at once after each optimizer step."""
    mxfp8: bool = False
    """MXFP8 linears: e4m3 values with one power-of-two scale per block of 32."""
    kernels: Kernels = "auto"
    """"auto" (hardware float8 matmuls where the GPU has them, else emulated), "emulated" (the
    same rounding, matmuls in high precision: any device) or "hardware" (an error without)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    seed_checkpoint: str = ""
    """Folder of the seed checkpoint (torch.distributed.checkpoint) to load; "" = random init."""
    create_seed_checkpoint: bool = False
    """Create the seed checkpoint in `seed_checkpoint` (single process) and exit."""
    save_at_step: int = 0
    """Write a training checkpoint (model, optimizer, LR schedule, data position, RNG, step;
    torch.distributed.checkpoint, sharded) into `save_folder` after this optimizer step and
    stop there (status "checkpointed"). 0 = never. See convergence.trainer.resume."""
    save_folder: str = ""
    """Where `save_at_step` writes the training checkpoint."""
    resume_from: str = ""
    """Folder of a training checkpoint to resume from, under this job's (possibly other)
    layout: train from its step + 1 to training.steps. A checkpoint that cannot serve this
    job is an error naming it, never a fresh start."""
    anchor_every: int = 0
    """Anchors (convergence.trainer.anchors): also write a training checkpoint after every
    `anchor_every`-th step (before the last) into `<dump_folder>/anchors/step<K>`, and go on
    training. 0 = never."""
    confirming_anchors: bool = False
    """With `anchor_every`: also write the state after each anchor's next step K+1 (as
    `anchors/step<K+1>`): the twin regime's confirming anchors (convergence.stats.anchored
    CONFIRMING_STEP: one step from K+1 confirms, or not, an outright miss one step from K)."""
    anchored_from: str = ""
    """Anchored steps (convergence.trainer.anchors): for each anchor K in this folder (written
    by another job's `anchor_every`), load it under this job's layout and train the steps
    K+1..K+`anchored_steps` from it; nothing else is trained."""
    anchored_steps: int = 1
    """With `anchored_from`: how many steps the job trains from each anchor (on the same
    batches as the run that saved it); never past the next anchor."""


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    dump_folder: str = "outputs/run"
    """Where metrics.jsonl, tb/ and run_meta.json go."""
    log_freq: int = 1
    """Log every N steps."""
    enable_tensorboard: bool = True
    val_every: int = 0
    """Validation loss every N steps (0 = off)."""
    val_batches: int = 2
    """Validation batches (of the global batch size) per evaluation."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    enable: bool = False
    """Numerics probe: train steps 1..`step`-1 as usual, then, in place of `step`, one
    forward+backward on its batch, write probe.json (per-module output norms, per-parameter
    gradient norms of the full tensors) in the dump folder and stop. See
    convergence.trainer.probe."""
    step: int = 1
    """The optimizer step (1-based) probed; 1 = from the seed weights."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    source: str = ""
    """The config file this came from (for messages); not a TOML key."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source", None)
        out["parallelism"] = self.parallelism.to_dict()
        return out


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(TrainConfig)[f.name]
    for f in fields(TrainConfig)
    if f.name != "source"
}


def _coerce(value: Any, target: Any, *, file: str, key: str) -> Any:
    """Check/convert a TOML or CLI value to the field's type; strings from the CLI are parsed."""
    if isinstance(target, types.UnionType) or typing.get_origin(target) is typing.Union:
        target = next(t for t in typing.get_args(target) if t is not type(None))
    if typing.get_origin(target) is Literal:
        # A closed choice is read as a string; whether it is one of the choices is
        # validate.check_config's question, whose message lists them under the key.
        target = str
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif target is int or target is float:
        # A TOML integer is a float too (lr = 1); a bool is never a number here.
        numbers = (int,) if target is int else (int, float)
        if isinstance(value, numbers) and not isinstance(value, bool):
            return target(value)
        if isinstance(value, str):
            try:
                return target(value)
            except ValueError:
                pass
    elif target is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - all fields are scalars
        return value
    raise SpecError(
        f"expected {target.__name__}, got {value!r}",
        file=file,
        key=key,
        fix=f"give {key} a {target.__name__} value",
    )


def _build_section(cls: type, data: dict[str, Any], *, file: str, section: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{section}.{key}"
        if key not in known:
            raise SpecError(
                "unknown key",
                file=file,
                key=path,
                fix=f"remove it; valid keys of [{section}]: {', '.join(sorted(known))}",
            )
        kwargs[key] = _coerce(value, hints[key], file=file, key=path)
        if section == "parallelism" and key in PP_DEFAULTED and kwargs[key] == 0:
            kwargs[key] = None  # the files' spelling of "unset" (see ParallelismConfig)
    return cls(**kwargs)


def parse_overrides(args: list[str], *, file: str = "command line") -> dict[str, dict[str, str]]:
    """``["--training.steps=5", "--parallelism.tp", "2"]`` -> {"training": {"steps": "5"}, ...}."""
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise SpecError(
                f"cannot read override {arg!r}",
                file=file,
                key=arg,
                fix="write overrides as --section.key=value",
            )
        if "=" in arg:
            dotted, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise SpecError(
                    "override has no value",
                    file=file,
                    key=arg,
                    fix="write it as --section.key=value",
                )
            dotted, value = arg[2:], args[i + 1]
            i += 2
        section, _, key = dotted.partition(".")
        out.setdefault(section, {})[key] = value
    return out


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a train config TOML and apply ``--section.key=value`` overrides on top."""
    path = Path(path)
    if not path.is_file() and shipped_config(str(path)) is not None:
        path = shipped_config(str(path)) or path  # `--config debug`: a shipped config
    file = str(path)
    if not path.is_file():
        raise SpecError(
            "train config not found",
            file=file,
            key="train_config",
            fix="point --config at an existing file or name a shipped config: "
            + ", ".join(shipped_configs()),
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(
            f"malformed TOML: {exc}", file=file, fix="fix the TOML syntax at the reported line"
        ) from None
    return build_train_config(data, overrides or [], file=file)


def build_train_config(data: dict[str, Any], overrides: list[str], *, file: str) -> TrainConfig:
    merged: dict[str, dict[str, Any]] = {}
    for section, body in data.items():
        if section not in SECTIONS:
            raise SpecError(
                "unknown section",
                file=file,
                key=section,
                fix=f"use one of [{'], ['.join(SECTIONS)}]",
            )
        if not isinstance(body, dict):
            raise SpecError(
                "expected a table",
                file=file,
                key=section,
                fix=f"write it as [{section}] with key = value lines",
            )
        merged[section] = dict(body)
    for section, body in parse_overrides(overrides).items():
        if section not in SECTIONS:
            raise SpecError(
                "unknown section in override",
                file="command line",
                key=section,
                fix=f"use one of {', '.join(SECTIONS)}",
            )
        merged.setdefault(section, {}).update(body)
    built = {
        name: _build_section(cls, merged.get(name, {}), file=file, section=name)
        for name, cls in SECTIONS.items()
    }
    return TrainConfig(**built, source=file)


def to_overrides(values: dict[str, Any]) -> list[str]:
    """{"training.steps": 5, "parallelism.sequence_parallel": True} -> CLI override strings."""
    out = []
    for dotted, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"--{dotted}={text}")
    return out

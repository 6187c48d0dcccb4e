"""A parallel layout (the degree of each mesh axis) and the techniques a job toggles.

:class:`Layout` is the one schema of a layout: the experiment spec's :class:`ParallelLayout`
(checked when built) and the built-in trainer's ``[parallelism]`` section
(convergence.trainer.config.ParallelismConfig: these fields plus the trainer's own, checked by
trainer/config_checks.py with the model and batch in view) both derive from it, so a field, its
default and how an unset PP default resolves are written once, here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

from convergence.spec import pp_schedules
from convergence.spec.errors import SpecError
from convergence.spec.pp_schedules import SCHEDULES, PPSchedule

#: Pipeline schedules the built-in trainer knows, by the name users write in TOML (one table
#: with the trainer's PP rules: spec/pp_schedules.py).
PP_SCHEDULES: tuple[PPSchedule, ...] = SCHEDULES

#: Mesh axis names, outermost first (the order torchtitan uses).
AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The degrees a layout reports (report.json, the matrix's dimensions): the mesh axes, and
#: expert parallelism, which borrows its ranks from dp_shard x cp (no axis of its own).
DEGREES: tuple[str, ...] = (*AXES, "ep")

ACMode = Literal["none", "full", "selective"]
"""Activation checkpointing: none, every block, or every n-th block."""
DType = Literal["float32", "bfloat16", "float16"]
"""A mixed-precision dtype (parameters in compute, gradient reduction)."""

Float8Recipe = Literal["none", "tensorwise", "rowwise"]
"""Float8 training of the linear layers (torchao): off, one scale per tensor, one per row."""

AC_MODES: tuple[ACMode, ...] = get_args(ACMode)
DTYPES: tuple[DType, ...] = get_args(DType)
FLOAT8_RECIPES: tuple[Float8Recipe, ...] = get_args(Float8Recipe)

#: The layout fields whose unset value means "derive it" (from the schedule and pp). Python
#: says unset with None; the trainer's TOML files and records spell it 0 (trainer/config.py
#: converts at that boundary, both ways).
PP_DEFAULTED: tuple[str, ...] = ("pp_microbatches", "pp_stages_per_rank")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(
            f"must be a positive integer, got {value!r}", key=name, fix=f"set {name} to 1 or more"
        )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Degree of each parallel mesh axis; their product is the world size.

    Unchecked: :class:`ParallelLayout` checks it as the experiment spec, the trainer's
    check_config as its [parallelism] section (their messages name their own keys).
    """

    dp_replicate: int = 1
    """Replicate axis: DDP on its own, the replicate axis of HSDP with ``dp_shard``."""
    dp_shard: int = 1
    """FSDP2 ``fully_shard`` axis."""
    tp: int = 1
    """Tensor parallel degree (DTensor ``parallelize_module``)."""
    sequence_parallel: bool = False
    """Shard norms/activations on the sequence dim between TP regions."""
    pp: int = 1
    """Pipeline parallel degree (number of PP ranks)."""
    pp_schedule: PPSchedule = "1F1B"
    """One of :data:`PP_SCHEDULES`."""
    pp_microbatches: int | None = None
    """Microbatches per local batch; default: ``pp`` (``2*pp`` for multi-stage schedules)."""
    pp_stages_per_rank: int | None = None
    """Stages held by each PP rank; default 1, or 2 for multi-stage schedules."""
    cp: int = 1
    """Context parallel degree (the sequence dim of attention is sharded)."""
    ep: int = 1
    """Expert parallel degree (MoE models): the routed experts are sharded over groups of ep
    ranks, which EP borrows from dp_shard x cp (as torchtitan does): it adds no ranks, the
    world size is the same with or without it. The experts' FSDP runs over the other
    dp_shard*cp/ep ranks."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many distinct batches are read per microstep."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        """Stages each PP rank holds, the default resolved (1 when PP is off)."""
        return pp_schedules.stages_per_rank(self.pp_schedule, self.pp_stages_per_rank, self.pp)

    @property
    def microbatches(self) -> int:
        """PP microbatches per local batch, the default resolved (1 when PP is off)."""
        if self.pp == 1:
            return 1
        return pp_schedules.microbatches(self.pp, self.stages_per_rank, self.pp_microbatches)

    def degrees(self) -> dict[str, int]:
        """Degree of each of :data:`DEGREES` (the mesh axes and ep)."""
        return {axis: int(getattr(self, axis)) for axis in DEGREES}

    def short_name(self) -> str:
        """e.g. ``fsdp2-tp2-pp2``; DDP-only layouts read ``ddp2``."""
        parts = []
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        elif self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        for axis in ("tp", "cp", "pp", "ep"):
            degree = getattr(self, axis)
            if degree > 1:
                parts.append(f"{axis}{degree}")
        return "-".join(parts) or "single"

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``ep`` only when set, so the job keys of layouts without expert
        parallelism stay what they were before it existed."""
        out = asdict(self)
        if out["ep"] == 1:
            del out["ep"]
        return out


#: The shared fields, in declaration order (the experiment's [parallelism] keys; the
#: trainer's [parallelism] section adds its own after them).
LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Layout))


@dataclass(frozen=True, kw_only=True)
class ParallelLayout(Layout):
    """A test or control side's layout (experiment TOML ``parallelism = {...}``), checked
    when built. Its fields are :class:`Layout`'s: ``to_dict`` (hashed into job keys) is
    theirs, in their order."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            _positive(name, getattr(self, name))
        if self.pp_schedule not in PP_SCHEDULES:
            raise SpecError(
                f"unknown PP schedule {self.pp_schedule!r}",
                key="pp_schedule",
                fix=f"use one of {', '.join(PP_SCHEDULES)}",
            )
        if self.pp_microbatches is not None:
            _positive("pp_microbatches", self.pp_microbatches)
        if self.pp_stages_per_rank is not None:
            _positive("pp_stages_per_rank", self.pp_stages_per_rank)
        if self.sequence_parallel and self.tp == 1:
            raise SpecError(
                "sequence_parallel needs tp > 1",
                key="sequence_parallel",
                fix="set tp >= 2 or drop sequence_parallel",
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise SpecError(
                f"ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp}: expert "
                "parallelism borrows its ranks from dp_shard x cp, it adds none",
                key="ep",
                fix="choose ep among the divisors of dp_shard*cp, or raise dp_shard",
            )


#: The precision techniques' fields at their defaults (off): left out of job keys and trainer
#: command lines while off.
PRECISION_DEFAULTS: dict[str, Any] = {"float8": "none", "float8_all_gather": False, "mxfp8": False}


@dataclass(frozen=True, kw_only=True)
class Techniques:
    """Training techniques a pair can toggle. None changes the math in fp32 but the precision
    techniques (float8, float8_all_gather, mxfp8), which change it on purpose
    (:attr:`numerics_changed`; docs/precision.md)."""

    param_dtype: DType = "float32"
    """Mixed-precision dtype of the unsharded parameters in compute."""
    reduce_dtype: DType = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce."""
    activation_checkpoint: ACMode = "none"
    """``none`` | ``full`` | ``selective``."""
    compile: bool = False
    """``torch.compile`` each block."""
    reshard_after_forward: bool = True
    """FSDP: free the unsharded params after forward (ZeRO-3) or keep them (ZeRO-2)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state."""
    grad_accum_steps: int = 1
    """Microsteps accumulated per optimizer step."""
    deterministic: bool = True
    """Deterministic kernels and seeded everything (required for paired verdicts)."""
    float8: Float8Recipe = "none"
    """Float8 linears (torchao): ``none`` | ``tensorwise`` | ``rowwise`` scaling; emulated
    matmuls on CPU, hardware float8 matmuls on GPUs that have them."""
    float8_all_gather: bool = False
    """FSDP2 all-gathers the float8 weights (needs ``float8 = "tensorwise"`` and FSDP)."""
    mxfp8: bool = False
    """MXFP8 linears (torchao: e4m3 values, one power-of-two scale per 32 elements)."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise SpecError(
                    f"unknown dtype {getattr(self, name)!r}",
                    key=name,
                    fix=f"use one of {', '.join(DTYPES)}",
                )
        if self.activation_checkpoint not in AC_MODES:
            raise SpecError(
                f"unknown mode {self.activation_checkpoint!r}",
                key="activation_checkpoint",
                fix=f"use one of {', '.join(AC_MODES)}",
            )
        _positive("grad_accum_steps", self.grad_accum_steps)
        if self.float8 not in FLOAT8_RECIPES:
            raise SpecError(
                f"unknown float8 recipe {self.float8!r}",
                key="float8",
                fix=f"use one of {', '.join(FLOAT8_RECIPES)}",
            )
        if self.float8_all_gather and self.float8 != "tensorwise":
            raise SpecError(
                "float8_all_gather all-gathers float8 weights with one scale per tensor",
                key="float8_all_gather",
                fix='set float8 = "tensorwise" too, or drop float8_all_gather',
            )
        if self.mxfp8 and self.float8 != "none":
            raise SpecError(
                "mxfp8 and float8 both convert the linear layers: choose one",
                key="mxfp8",
                fix='drop mxfp8, or set float8 = "none"',
            )

    @property
    def numerics_changed(self) -> bool:
        """True when a technique changes the arithmetic on purpose (a float8 or MX format):
        such a test is judged for "as good as the control", never "equal" (regimes/margin.py)."""
        return self.float8 != "none" or self.mxfp8

    @property
    def bitwise_pairable(self) -> bool:
        """True when two runs can be compared step by step at the fp32 noise floor.

        Any dtype below fp32 (compute *or* gradient reduction: a bf16 reduce-scatter rounds
        every gradient), compiled kernels (fusions reorder float arithmetic) and
        nondeterministic kernels each add noise far above that floor, so the paired tolerance
        would fail a correct run; a float8/MX format rounds every matmul input on purpose.
        """
        return (
            self.deterministic
            and not self.numerics_changed
            and self.param_dtype == "float32"
            and self.reduce_dtype == "float32"
            and not self.compile
        )

    def changed_from(self, other: Techniques) -> dict[str, Any]:
        """The fields whose value differs from ``other`` (for report columns)."""
        mine, theirs = asdict(self), asdict(other)
        return {k: v for k, v in mine.items() if theirs[k] != v}

    def to_dict(self) -> dict[str, Any]:
        """The fields; the precision techniques only when set, so the job keys of jobs without
        them stay what they were before they existed (as Layout.to_dict does for ``ep``)."""
        out = asdict(self)
        for name, default in PRECISION_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out

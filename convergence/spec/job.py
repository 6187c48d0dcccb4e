"""One side of a pair: what to train, on which layout, for how long."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from convergence.spec.errors import SpecError
from convergence.spec.layout import ParallelLayout, Techniques
from convergence.spec.resume import Resume
from convergence.spec.trainer_request import TrainerRequest

HookMode = Literal["after", "replace_tp"]
"""How a hook meets the built-in parallelisation: after it, or applying TP in its place."""
HOOK_MODES: tuple[HookMode, ...] = get_args(HookMode)

#: A sanity bound, not a budget: a typo like ``steps = 1000000000`` is caught at collection.
MAX_STEPS = 10_000_000


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A training job, complete enough to launch and to hash for the run cache."""

    name: str
    """Human name (``fsdp2-tp2``); not part of the cache key."""
    train_config: Path
    """Absolute path of the train config TOML (built-in/torchtitan) the job starts from."""
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    """Degrees of the parallel mesh axes."""
    techniques: Techniques = field(default_factory=Techniques)
    """Toggled training techniques."""
    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 42
    """Seed of the weights (via the seed checkpoint) and of the data order."""
    backend: str = "builtin"
    """``builtin`` | ``torchtitan`` | ``command``, or one an installed package registers
    (convergence.backends.registry; an unknown name is a preflight error)."""
    local_batch_size: int | None = None
    """Samples per DP rank per microstep; ``None`` keeps the train config's value."""
    hook: str | None = None
    """``"package.module:function"`` applied to the model on every rank (runs user code)."""
    hook_mode: HookMode = "after"
    """``after`` (hook runs after the built-in parallelisation) or ``replace_tp``."""
    overrides: tuple[tuple[str, str], ...] = ()
    """Extra ``key.path=value`` settings passed to the backend verbatim (never via a shell)."""
    backend_options: tuple[tuple[str, str], ...] = ()
    """Backend-specific settings (command template, metric keys, torchtitan module)."""
    source: str = ""
    """Where this job was defined (file path), for error messages."""
    resume: Resume | None = None
    """Test sides only: stop after ``resume.at_step``, checkpoint, resume on ``resume.layout``
    (convergence.spec.resume); None: one uninterrupted job."""
    request: TrainerRequest = field(default_factory=TrainerRequest)
    """What the library asks of the trainer beyond training the job (save anchors, train from
    them, checkpoint and stop, resume, probe: convergence.spec.trainer_request); set by run/
    and checks/, never by an experiment file. Each backend turns it into its own command."""
    device: str = "auto"
    """``auto``: the session's devices (GPUs where torch sees them, else CPU); ``cpu``: on CPU
    slots with the GPUs hidden (set by the placement at collection, never by an experiment file:
    convergence.launch.placement). Part of the run-cache key only when ``cpu``."""

    def __post_init__(self) -> None:
        # The name becomes part of a pytest node id (``file.toml::name``) and of run folder
        # names: "::" would split the id, a path separator would escape the folder.
        if not isinstance(self.name, str) or not self.name.strip():
            raise SpecError(
                "a job needs a non-empty name",
                file=self.source,
                key="name",
                fix='set name = "fsdp2-tp2" (letters, digits, -, _, .)',
            )
        bad = [s for s in ("::", "/", "\\") if s in self.name]
        if bad:
            raise SpecError(
                f"name {self.name!r} contains {bad[0]!r}",
                file=self.source,
                key="name",
                fix="use letters, digits, '-', '_' or '.' in names",
            )
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise SpecError(
                f"seed must be an integer in [0, 2**32), got {self.seed!r}",
                file=self.source,
                key="seed",
                fix="set seed = 42 (any 0..4294967295)",
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise SpecError(
                f"backend must be a name, got {self.backend!r}",
                file=self.source,
                key="backend",
                fix='set backend = "builtin" (or another backend)',
            )
        if not isinstance(self.steps, int) or not 1 <= self.steps <= MAX_STEPS:
            raise SpecError(
                f"steps must be an integer in [1, {MAX_STEPS}], got {self.steps!r}",
                file=self.source,
                key="steps",
                fix="set steps >= 1 (a convergence test rarely needs more than a "
                "few thousand; the wall limit ends a job that runs too long)",
            )
        if self.local_batch_size is not None and self.local_batch_size < 1:
            raise SpecError(
                "local_batch_size must be >= 1",
                file=self.source,
                key="local_batch_size",
                fix="set local_batch_size >= 1",
            )
        if self.hook is not None and (":" not in self.hook or self.hook.count(":") != 1):
            raise SpecError(
                f"hook {self.hook!r} is not 'package.module:function'",
                file=self.source,
                key="hook",
                fix='write it as "my_pkg.parallel:apply_my_tp"',
            )

        if self.device not in ("auto", "cpu"):
            raise ValueError(f"job device must be 'auto' or 'cpu', got {self.device!r}")
        if self.hook_mode not in HOOK_MODES:
            raise SpecError(
                f"unknown hook_mode {self.hook_mode!r}",
                file=self.source,
                key="hook_mode",
                fix='use "after" or "replace_tp"',
            )

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def after_resume(self) -> JobSpec:
        """The job that resumes: the resume layout, techniques and local batch, same steps
        (the LR schedule spans the whole run). Raises ValueError on a job without resume."""
        if self.resume is None:
            raise ValueError(f"job {self.name!r} does not resume")
        resume = self.resume
        return dataclasses.replace(
            self,
            layout=resume.layout,
            techniques=resume.techniques,
            resume=None,
            local_batch_size=(
                resume.local_batch_size
                if resume.local_batch_size is not None
                else self.local_batch_size
            ),
        )

    def asking(self, **parts: Any) -> JobSpec:
        """The job with these parts added to its trainer request (TrainerRequest's fields)."""
        return dataclasses.replace(self, request=dataclasses.replace(self.request, **parts))

    def override_dict(self) -> dict[str, str]:
        return dict(self.overrides)

    def identity(self) -> dict[str, Any]:
        """Everything that decides the job's result (the run-cache key covers this)."""
        return {
            "train_config": str(self.train_config),
            "layout": self.layout.to_dict(),
            "techniques": self.techniques.to_dict(),
            "steps": self.steps,
            "seed": self.seed,
            "backend": self.backend,
            "local_batch_size": self.local_batch_size,
            "hook": self.hook,
            "hook_mode": self.hook_mode,
            # The request as the overrides it was before it had a type, after the user's: the
            # keys stay what they were (TrainerRequest.as_overrides).
            "overrides": [list(kv) for kv in (*self.overrides, *self.request.as_overrides())],
            "backend_options": [list(kv) for kv in self.backend_options],
            # Only when set: the keys of jobs without a resume stay what they were.
            **({"resume": self.resume.to_dict()} if self.resume is not None else {}),
            **({"device": self.device} if self.device != "auto" else {}),
            **({"probe_step": self.request.probe_step} if self.request.probe_step else {}),
        }

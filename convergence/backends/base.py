"""The Backend Protocol: one per trainer (built-in, torchtitan, any command, or a third
party's: convergence.backends.registry loads them by name from entry points).

What a backend can do beyond running a job -- resume, a numerics probe, twins by default, the
identity of its code -- it states (:class:`Capabilities`, :meth:`Backend.code_identity`); the
rest of the library asks, and never tests a backend's name (tests/test_names_stay_home.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from convergence.metrics.curve import RunMetrics
from convergence.spec.job import JobSpec


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend offers; the defaults are what any backend can do (run a job)."""

    resume: bool = False
    """A test side may checkpoint at step K and resume under another layout
    (spec/resume.py, run/resume.py): the backend turns the request's ``save_at`` and
    ``resume_from`` (spec/trainer_request.py) into its trainer's words."""
    probe: bool = False
    """The trainer has the numerics probe mode (the request's ``probe_step``: run/probe.py)."""
    anchors: bool = False
    """The anchored check (checks/anchored.py): the control saves its whole state every N steps
    (the request's ``anchor_every``) and a job trains one step from each of those states
    (``anchored_from``)."""
    anchors_keep_dp: bool = False
    """The anchored job must keep the control's data-parallel degree: the trainer's data
    position cannot move onto another one when it loads an anchor (torchtitan's dataloader)."""
    twins_by_default: bool = False
    """``noise_twin`` derives twins for the usual controls: where both sides' backends do
    (and the runs are not bitwise pairable), twin is a pair's default regime, else the seed
    band is."""
    device_follows_placement: bool = False
    """The job runs on whatever device the pair's placement gives it (``--convergence-device``,
    GPU slots shared through gloo, CPU when GPUs are too few); False: the backend's own config
    decides its device, so its pairs are never moved (convergence/launch/placement.py)."""
    shipped_train_configs: bool = False
    """The shipped train configs (``convergence configs``) are this trainer's: a missing
    ``train_config`` file's fix names them (spec/experiment.py MissingTrainConfig)."""
    needs_train_config: bool = True
    """A job must name a train config file (``train_config``)."""
    seed_is_a_job: bool = False
    """The seed checkpoint is made by a one-rank distributed job (its ``seed_entry`` is a rank's
    entry, started like a training job's ranks: forked from the warm server, or by torchrun);
    False: ``seed_entry`` is one plain process of ours (no process group)."""
    warm_imports: tuple[str, ...] = ()
    """Modules the backend's ranks import that a warm start imports once, in a fork server of
    their own (LaunchRequest.warm_imports); empty: the server's stack is all they need."""
    train_config_fix: str = (
        "set train_config to your trainer's config file (hashed into the run-cache key, so a "
        "changed config is never mistaken for a cached one)"
    )
    """The fix when a job that needs one names none."""


@dataclass(frozen=True, kw_only=True)
class CodeIdentity:
    """How a job's trainer code is identified (the run cache; ``convergence bisect``)."""

    keyed: bool
    """The run-cache key holds the content of the code the job runs (its package version
    and sources, or the files ``backend_options.sources`` lists)."""
    packages: tuple[str, ...] = ()
    """Top-level packages of that code: when the repository being bisected holds one (the
    trainer's own repository), its git tree id at each commit identifies the code."""
    note: str = ""
    """When not keyed: what a stale reuse would come from and the fix (the report says it)."""


class Backend(Protocol):
    name: str
    capabilities: Capabilities

    def version(self) -> str:
        """Goes into the run-cache key: a new trainer version never reuses old runs."""
        ...

    def code_identity(self, job: JobSpec) -> CodeIdentity:
        """How the code ``job`` runs is identified (cache key, bisect)."""
        ...

    def preflight(self, job: JobSpec) -> None:
        """Validate the job without launching anything; raise SpecError naming file/key/fix."""
        ...

    def tokens_per_step(self, job: JobSpec) -> int:
        """Tokens consumed per optimizer step (must match between control and test)."""
        ...

    def config_text(self, job: JobSpec) -> str:
        """The train config's text (part of the cache key)."""
        ...

    def seed_identity(self, job: JobSpec) -> dict[str, Any] | None:
        """What decides the seed checkpoint's content; None = this backend makes none."""
        ...

    def seed_entry(self, job: JobSpec, seed_dir: Path) -> list[str]:
        """argv (after the python executable) that creates the seed checkpoint in one process."""
        ...

    def train_entry(self, job: JobSpec, dump_dir: Path, seed_dir: Path | None) -> list[str]:
        """argv after torchrun's own options, e.g. ``["-m", "convergence.trainer", ...]``."""
        ...

    def launches_itself(self, job: JobSpec) -> bool:
        """True when the train entry is a whole command that starts its own ranks."""
        ...

    def metrics_path(self, job: JobSpec, dump_dir: Path) -> Path | None:
        """What is read live while the job runs (None: nothing, poll nothing): the JSONL file,
        or the folder of TensorBoard event files (see ``metrics_format``)."""
        ...

    def metrics_format(self, job: JobSpec) -> str:
        """``jsonl`` or ``tensorboard``: how ``metrics_path`` is read live."""
        ...

    def stop_file(self, job: JobSpec, dump_dir: Path) -> Path | None:
        """The file whose creation asks the job to stop at its next step (early stopping);
        None: the trainer has none, and an early stop ends its processes."""
        ...

    def record_keys(self, job: JobSpec) -> dict[str, str] | None:
        """Map of the live records' key names (JSONL keys, TensorBoard tags) to ours (None:
        they are ours already)."""
        ...

    def read_metrics(self, job: JobSpec, dump_dir: Path) -> RunMetrics:
        """All curves of a finished (or stopped) run, at full precision."""
        ...

    def read_meta(self, job: JobSpec, dump_dir: Path) -> dict[str, Any]:
        """Run metadata (seed checkpoint hash, entropy floor, ...); {} when there is none."""
        ...

    def noise_twin(self, job: JobSpec) -> JobSpec | None:
        """The job's *noise twin* for the twin regime (convergence/regimes/twin.py): a job
        that reads the very same samples per optimizer step from the same seed checkpoint,
        with the same precision and techniques, and differs from ``job`` only by legitimate
        numerical noise -- typically another data-parallel degree, so gradients are reduced in
        another order and rounded at other points. The regime compares the test with the
        control within k x the measured |twin - control|.

        Return None when this backend cannot derive twins at all (the twin regime then says
        so and points at ``regime = "seed"``); raise SpecError (key ``regime``, with a fix)
        when it can in general but not for this job. The twin must pass this backend's
        preflight and keep ``tokens_per_step``. Called at collection (preflight) and again
        by the runner; it must not launch anything.
        """
        ...

    def forward_twin(self, job: JobSpec, *, tp: int = 2) -> JobSpec | None:
        """The job's *forward-noise twin* (twin regime): ``job`` itself with its forward pass
        rounded at every step as a tensor-parallel layout of ``tp`` ranks rounds it (the
        built-in trainer computes each split matmul in ``tp`` rounded slices and adds them:
        convergence/trainer/forward_noise.py). The regime asks for one twin per degree of
        ``regimes.twin.forward_twin_degrees`` (TP2; for a TP4 test also TP4: the four partial
        sums' order is the all-reduce's, which no one twin reproduces).

        Why a second twin: the DP noise twin changes only the gradient reduction, while a
        tensor- or context-parallel test also rounds its forward differently at every step,
        a larger perturbation that the run's chaos grows at the same rate (BENCHMARKS.md,
        "Twin envelope on other models"). Return None when the trainer has no such knob: the
        envelope is then measured on the noise twin alone. Same contract as ``noise_twin``:
        same seed checkpoint, samples and tokens per step; must not launch anything.
        """
        ...

"""Preflight: the checks of a parsed pair that need more than its file -- the backends (their
own preflight: the trainer's validation of the effective train config, torchtitan's parser),
tokens per optimizer step, seeds, and the devices the session may use.

``convergence.spec`` parses and stays the bottom layer (standard library only); this module
sits above the backends, and every caller that is about to run pairs calls it explicitly: the
plugin's collection and ``convergence_pair`` fixture, ``convergence run`` and ``ab``.
An invalid pair still fails before anything is launched, with file, key and fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convergence.backends import Backend, get_backend
from convergence.backends.registry import not_importable
from convergence.backends.tokens import batch_fix
from convergence.checks import checks_of, pair_keys, validate_keys
from convergence.launch.placement import FIX_MORE_DEVICES, NotPlaceable, place
from convergence.regimes import REGISTRY, get_regime
from convergence.spec.errors import NotRunnableHere, SpecError
from convergence.spec.experiment import (
    JOB_KEYS,
    NO_TRAIN_CONFIG,
    TIERS,
    Experiment,
    MissingTrainConfig,
    load_experiment,
    make_pair,
)
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec

if TYPE_CHECKING:
    from convergence.launch.pool import DeviceSet


def ships_train_configs(backend: str) -> bool:
    """Whether the shipped train configs are the backend called ``backend``'s (False where it
    cannot be loaded)."""
    try:
        return get_backend(backend).capabilities.shipped_train_configs
    except SpecError:
        return False


def twins_by_default(backend: str) -> bool:
    """Whether the backend called ``backend`` derives twins for the usual controls (False
    where it cannot be loaded: check_pair then names the problem)."""
    try:
        return get_backend(backend).capabilities.twins_by_default
    except SpecError:
        return False


#: The regimes as the experiment parser sees them: the default regime asks the backends.
REGIMES = REGISTRY.seen_by(twins_by_default)


def load_checked(
    path: Path,
    *,
    rootdir: Path,
    max_tier: str | None = None,
    not_runnable: dict[str, NotRunnableHere] | None = None,
    modify: Callable[[PairSpec], PairSpec | None] | None = None,
    steps: int | None = None,
) -> Experiment:
    """Parse an experiment file and preflight its pairs. Raises SpecError.

    Pairs of a tier above ``max_tier`` are parsed (unknown keys are still errors) but their
    backend preflight is skipped: they will not run, and a backend's preflight can be costly
    (torchtitan's parser imports its models) or need an optional extra.
    ``not_runnable``: where a pair's :class:`NotRunnableHere` (a backend that is not
    installed) is recorded, by pair name, instead of raised (the plugin skips those pairs).
    ``modify``: what another plugin makes of each pair (the plugin's
    ``pytest_convergence_modify_pair``), applied *before* the checks, so a pair a hook changes
    is checked like any other.
    ``steps``: the session's step override (``--convergence-steps``), checked against each
    pair's anchors and resume step here, before any job runs.
    """
    try:
        experiment = load_experiment(
            path, rootdir=rootdir, regimes=REGIMES, checks_keys=pair_keys()
        )
    except MissingTrainConfig as exc:
        raise exc.worded(shipped=ships_train_configs(exc.backend)) from None
    if modify is not None:
        pairs = tuple(modify(pair) or pair for pair in experiment.pairs)
        experiment = dataclasses.replace(experiment, pairs=pairs)
    for pair, key in zip(experiment.pairs, experiment.keys, strict=True):
        validate_keys(pair, key=key, steps=steps if in_tier(pair, max_tier) else None)
        if in_tier(pair, max_tier):
            check_steps_override(pair, steps, key=key)
            try:
                check_pair(pair, key=key)
            except NotRunnableHere as exc:
                if not_runnable is None:
                    raise
                not_runnable[pair.name] = exc
    return experiment


def check_steps_override(pair: PairSpec, steps: int | None, *, key: str) -> None:
    """A session's ``--convergence-steps`` that leaves the test's resume nothing to do is an
    error at collection: the file's own steps were checked when it was parsed, the override
    only now (it used to surface after two jobs had run). The checks' keys are checked against
    it by the checks themselves (Check.validate: the anchored check's anchor_every)."""
    if steps is None:
        return
    resume = pair.test.resume
    if resume is not None and resume.at_step >= steps:
        raise SpecError(
            f"--convergence-steps {steps} ends the run before the test's resume at step "
            f"{resume.at_step}",
            file=pair.source,
            key=f"{key}.resume.at_step",
            fix=f"run more than {resume.at_step} steps (--convergence-steps "
            f"{resume.at_step + 1} or more), or deselect this pair",
        )


def make_checked_pair(
    *, modify: Callable[[PairSpec], PairSpec | None] | None = None, **kwargs: Any
) -> PairSpec:
    """:func:`convergence.spec.experiment.make_pair`, then ``modify`` (as in
    :func:`load_checked`), then :func:`check_pair`."""
    pair = make_pair(**kwargs, regimes=REGIMES, checks_keys=pair_keys())
    if modify is not None:
        pair = modify(pair) or pair
    validate_keys(pair, key=str(kwargs.get("key", "test")))
    check_pair(pair, key=str(kwargs.get("key", "test")))
    return pair


def in_tier(pair: PairSpec, max_tier: str | None) -> bool:
    return max_tier is None or TIERS.index(pair.tier) <= TIERS.index(max_tier)


def check_pair(pair: PairSpec, *, key: str = "test") -> None:
    """Invariants of a pair that need no devices: same data, same tokens per step, valid jobs."""
    file = pair.source
    control, test = pair.control, pair.test
    backends = _side_backends(pair, key)
    # The pair's checks (anchored, resumed, ...: convergence/checks/), each its own refusals.
    for check in checks_of(pair):
        check.refuse(pair, backends, key=key)
    try:
        regime = get_regime(pair.regime)
    except SpecError as exc:
        raise SpecError(exc.detail, file=file, key=f"{key}.regime", fix=exc.fix) from None
    # The regime's own checks (same seed, its control jobs can be derived, ...), then each
    # regime's say on the methods that need its control jobs.
    regime.check(pair, key=key, backend=backends["control"])
    for other in REGISTRY.all():
        other.check_method_use(pair, key=key)
    if pair.probe_always and not all(b.capabilities.probe for b in backends.values()):
        raise SpecError(
            'probe = "always" needs a trainer with a probe mode on both sides (the '
            "built-in one, torchtitan; command jobs are never probed)",
            file=file,
            key=f"{key}.probe",
            fix='drop probe = "always" for this pair',
        )
    if control.backend == test.backend:
        backend = backends["control"]
        ctrl_tokens, test_tokens = backend.tokens_per_step(control), backend.tokens_per_step(test)
        if ctrl_tokens != test_tokens:
            raise SpecError(
                f"tokens per optimizer step differ: control {ctrl_tokens} vs test {test_tokens} "
                "(local batch x DP x grad accumulation x seq_len)",
                file=file,
                key=f"{key}.local_batch_size",
                fix=batch_fix(backend, test, ctrl_tokens),
            )


def _side_backends(pair: PairSpec, key: str) -> dict[str, Backend]:
    """Each side's backend, looked up once, with its train config and its own preflight
    checked; an error names the experiment file and the side's key."""
    file = pair.source
    control, test = pair.control, pair.test
    # Each side's backend, looked up once; what it works out of a job (the effective train
    # config) is worked out once per job and kept (backends/effective.py), so the regime's
    # checks, the tokens per step and the runner later only look it up.
    backends: dict[str, Backend] = {}
    for side_key, job in (("control", control), (key, test)):
        try:
            backends[side_key] = get_backend(job.backend)
            check_train_config(job, backends[side_key])
            backends[side_key].preflight(job)
        except ImportError as exc:
            # The backend's package is installed but cannot import here (torchtitan built for
            # a newer torch than this one): not an error in the file, a session that lacks
            # what the pair needs.
            raise not_importable(
                job.backend, exc, file=file, where=f"[{side_key} {job.name!r}] "
            ) from None
        except SpecError as exc:
            # A pair this session cannot run (the backend is not installed) stays that kind:
            # collection skips it (load_checked), --convergence-strict makes it an error.
            error = NotRunnableHere if isinstance(exc, NotRunnableHere) else SpecError
            # Name the experiment file (what the user edits); a check made on the effective
            # train config says so and points at it too.
            if exc.file and exc.file != file:
                raise error(
                    f"[{side_key} {job.name!r}] {exc.detail} (checked on the "
                    f"effective train config {exc.file}, key '{exc.key}')",
                    file=file,
                    key=f"{side_key}.{exc.key}" if exc.key else side_key,
                    fix=exc.fix,
                ) from None
            key_path = (
                f"{side_key}.{exc.key}"
                if exc.key in JOB_KEYS or (exc.key or "").startswith("resume.")
                else exc.key
            )
            raise error(
                f"[{side_key} {job.name!r}] {exc.detail}",
                file=exc.file or file,
                key=key_path,
                fix=exc.fix,
            ) from None
    return backends


def check_train_config(job: JobSpec, backend: Backend) -> None:
    """A job of a backend that needs a train config file names one."""
    if backend.capabilities.needs_train_config and str(job.train_config) == NO_TRAIN_CONFIG:
        raise SpecError(
            "no train_config", key="train_config", fix=backend.capabilities.train_config_fix
        )


def pair_jobs(pair: PairSpec) -> list[tuple[str, JobSpec]]:
    """Every job a pair may launch, by side: control and test, the regime's other control
    jobs (a twin, seed replicates), the test after its resume."""
    jobs = [("control", pair.control), ("test", pair.test)]
    if not pair.golden:
        regime = get_regime(pair.regime)
        others = regime.control_jobs(pair, get_backend(pair.control.backend))[1:]
        jobs.extend(("control", job) for job in others)
    if pair.test.resume is not None:
        jobs.append(("test", pair.test.after_resume()))
    return jobs


def validate_devices(
    pair: PairSpec, *, available_devices: int | DeviceSet | None, device_mode: str = "auto"
) -> PairSpec:
    """World size vs. the devices this session may use (a count, or the session's
    DeviceSet, which also knows nodes: a job larger than a node needs whole nodes). Raises
    NotRunnableHere naming what the pair needs.

    With a DeviceSet, the pair is also placed (convergence.launch.placement: one GPU per rank,
    ranks sharing GPUs, or CPU; ``device_mode`` auto | cuda | cpu): the pair returned carries
    the placement, its jobs the device to run on. Run that one."""
    if available_devices is None:
        return pair
    jobs = pair_jobs(pair)
    if isinstance(available_devices, int):
        for side, job in jobs:
            if job.world_size > available_devices:
                raise NotRunnableHere(
                    f"{side} {job.name!r} ({job.layout.short_name()}) needs {job.world_size} "
                    f"devices, only {available_devices} available",
                    file=pair.source,
                    key=f"{side}.parallelism",
                    fix=FIX_MORE_DEVICES,
                )
        return pair
    try:
        fixed = frozenset(
            job.backend
            for _, job in jobs
            if not get_backend(job.backend).capabilities.device_follows_placement
        )
        placement = place([job for _, job in jobs], available_devices, device_mode, fixed=fixed)
    except NotPlaceable as exc:
        side, job = max(jobs, key=lambda sj: sj[1].world_size)
        raise NotRunnableHere(
            f"{side} {job.name!r} ({job.layout.short_name()}): {exc.detail}",
            file=pair.source,
            key=f"{side}.parallelism",
            fix=exc.fix,
        ) from None
    return dataclasses.replace(
        pair,
        control=placement.apply(pair.control),
        test=placement.apply(pair.test),
        placement=placement.text,
    )

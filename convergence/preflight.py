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
from pathlib import Path
from typing import Any

from convergence.spec.errors import SpecError
from convergence.spec.experiment import (
    JOB_KEYS,
    TIERS,
    Experiment,
    load_experiment,
    make_pair,
)
from convergence.spec.job import JobSpec
from convergence.spec.pair import PairSpec


def load_checked(path: Path, *, rootdir: Path, max_tier: str | None = None) -> Experiment:
    """Parse an experiment file and preflight its pairs. Raises SpecError.

    Pairs of a tier above ``max_tier`` are parsed (unknown keys are still errors) but their
    backend preflight is skipped: they will not run, and a backend's preflight can be costly
    (torchtitan's parser imports its models) or need an optional extra.
    """
    experiment = load_experiment(path, rootdir=rootdir)
    for pair, key in zip(experiment.pairs, experiment.keys, strict=True):
        if in_tier(pair, max_tier):
            check_pair(pair, key=key)
    return experiment


def make_checked_pair(**kwargs: Any) -> PairSpec:
    """:func:`convergence.spec.experiment.make_pair` plus :func:`check_pair`."""
    pair = make_pair(**kwargs)
    check_pair(pair, key=str(kwargs.get("key", "test")))
    return pair


def in_tier(pair: PairSpec, max_tier: str | None) -> bool:
    return max_tier is None or TIERS.index(pair.tier) <= TIERS.index(max_tier)


def check_pair(pair: PairSpec, *, key: str = "test") -> None:
    """Invariants of a pair that need no devices: same data, same tokens per step, valid jobs."""
    # Lazy: backends import numpy and the trainer's config; importing this module (the plugin
    # does at startup) must cost a pytest session without convergence items nothing.
    from convergence.backends import get_backend  # lazy: see the comment above

    file = pair.source
    control, test = pair.control, pair.test
    for side_key, job in (("control", control), (key, test)):
        backend = get_backend(job.backend)
        try:
            backend.preflight(job)
        except SpecError as exc:
            # Name the experiment file (what the user edits); a check made on the effective
            # train config says so and points at it too.
            if exc.file and exc.file != file:
                raise SpecError(f"[{side_key} {job.name!r}] {exc.detail} (checked on the "
                                f"effective train config {exc.file}, key '{exc.key}')",
                                file=file, key=f"{side_key}.{exc.key}" if exc.key else side_key,
                                fix=exc.fix) from None
            key_path = f"{side_key}.{exc.key}" if exc.key in JOB_KEYS else exc.key
            raise SpecError(f"[{side_key} {job.name!r}] {exc.detail}",
                            file=exc.file or file, key=key_path, fix=exc.fix) from None
    if pair.probe_always and {control.backend, test.backend} != {"builtin"}:
        raise SpecError("probe = \"always\" needs the built-in trainer on both sides (only it "
                        "has a probe mode; torchtitan and command jobs are never probed)",
                        file=file, key=f"{key}.probe", fix='drop probe = "always" for this pair')
    if pair.regime in ("paired", "twin") and control.seed != test.seed:
        raise SpecError(f"{pair.regime} comparison needs the same seed (same seed checkpoint "
                        "and data)", file=file, key=f"{key}.seed",
                        fix='use the same seed on both sides, or regime = "seed"')
    twin_rules = [r.metric for r in pair.rules if r.method == "twin"]
    if twin_rules and pair.regime != "twin":
        raise SpecError(f"compare.{twin_rules[0]} = \"twin\" needs the twin regime (it "
                        "compares with a twin of the control that only that regime runs)",
                        file=file, key=f"{key}.compare.{twin_rules[0]}",
                        fix='set regime = "twin", or another method for this metric')
    if pair.regime == "twin" and not pair.golden:
        try:
            noise_twin(control)
        except SpecError as exc:
            raise SpecError(f"[control {control.name!r}] {exc.detail}", file=file,
                            key=f"{key}.regime", fix=exc.fix) from None
    if control.backend == test.backend:
        backend = get_backend(control.backend)
        ctrl_tokens, test_tokens = backend.tokens_per_step(control), backend.tokens_per_step(test)
        if ctrl_tokens != test_tokens:
            raise SpecError(
                f"tokens per optimizer step differ: control {ctrl_tokens} vs test {test_tokens} "
                "(local batch x DP x grad accumulation x seq_len)", file=file,
                key=f"{key}.local_batch_size",
                fix=_batch_fix(control, test, ctrl_tokens, test_tokens))


def noise_twin(control: JobSpec) -> JobSpec:
    """The control's twin for the twin regime (convergence/stats/twin.py): the same seed
    checkpoint, samples, precision and techniques, with another data-parallel degree, so its
    gradients are reduced in another order and rounded at other points -- legitimate noise only.

    Twice the FSDP degree with half the local batch where the local batch is even (every
    optimizer step reads the very same samples: convergence.trainer.data.BatchPlan); else half
    the FSDP degree with twice the gradient accumulation (fewer ranks, same samples). Raises
    SpecError with a fix when neither keeps the tokens per step.
    """
    from convergence.backends import get_backend  # lazy: see check_pair
    from convergence.backends.builtin import BuiltinBackend  # lazy: see check_pair

    if control.backend != "builtin":
        derive = getattr(get_backend(control.backend), "noise_twin", None)
        if derive is None:
            raise SpecError(f"the twin regime needs a twin of the control derived by its "
                            f"backend; the {control.backend!r} backend derives none",
                            key="regime", fix='use regime = "seed" for this backend')
        twin: JobSpec = derive(control)
        return twin
    cfg = BuiltinBackend().effective_config(control)
    layout, tech = control.layout, control.techniques
    local = cfg.training.local_batch_size
    if local % 2 == 0:
        twin = dataclasses.replace(
            control, name=f"{control.name}-twin", local_batch_size=local // 2,
            layout=dataclasses.replace(layout, dp_shard=layout.dp_shard * 2))
    elif layout.dp_shard % 2 == 0 and (layout.dp_shard // 2) * layout.cp > 1:
        twin = dataclasses.replace(
            control, name=f"{control.name}-twin",
            layout=dataclasses.replace(layout, dp_shard=layout.dp_shard // 2),
            techniques=dataclasses.replace(tech, grad_accum_steps=tech.grad_accum_steps * 2))
    else:
        raise SpecError(f"no noise twin for control {control.name!r}: its local batch "
                        f"({local}) is odd and its FSDP degree ({layout.dp_shard}) cannot be "
                        "halved", key="regime",
                        fix="use an even local_batch_size on the control, or regime = \"seed\"")
    backend = get_backend("builtin")
    backend.preflight(twin)
    if backend.tokens_per_step(twin) != backend.tokens_per_step(control):
        raise SpecError(f"the twin of {control.name!r} would read other tokens per step",
                        key="regime", fix='use regime = "seed" for this control')
    return twin


def _batch_fix(control: JobSpec, test: JobSpec, ctrl_tokens: int, test_tokens: int) -> str:
    from convergence.backends.builtin import BuiltinBackend  # lazy: see check_pair

    if test.backend != "builtin":
        return "make local batch x DP x grad accumulation equal on both sides"
    cfg = BuiltinBackend().effective_config(test)
    per_sample = test.layout.dp * cfg.training.grad_accum_steps * cfg.data.seq_len
    if ctrl_tokens % per_sample == 0:
        return (f"set local_batch_size = {ctrl_tokens // per_sample} on the test "
                f"(its DP degree is {test.layout.dp}, grad accumulation "
                f"{cfg.training.grad_accum_steps})")
    return ("change the test's local_batch_size or techniques.grad_accum_steps so that "
            "local batch x DP x grad accumulation matches the control")


def validate_devices(pair: PairSpec, *, available_devices: int | None) -> None:
    """World size vs. the devices this session may use."""
    if available_devices is None:
        return
    jobs = [("control", pair.control), ("test", pair.test)]
    if pair.regime == "twin" and not pair.golden:
        jobs.append(("control", noise_twin(pair.control)))
    for side, job in jobs:
        if job.world_size > available_devices:
            raise SpecError(
                f"{side} {job.name!r} needs {job.world_size} devices "
                f"({job.layout.short_name()}), only {available_devices} available",
                file=pair.source, key=f"{side}.parallelism",
                fix="lower the degrees, or raise --convergence-devices (CPU slots may "
                    "oversubscribe cores)")


def validate_pair(pair: PairSpec, *, available_devices: int | None) -> None:
    check_pair(pair)
    validate_devices(pair, available_devices=available_devices)


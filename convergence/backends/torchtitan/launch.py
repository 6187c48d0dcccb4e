"""torchtitan's own ``torchtitan.train`` behind a thin wrapper: the entry point of every
torchtitan job (``torchrun ... -m convergence.backends.torchtitan.launch [ours] [theirs]``).

The wrapper removes its own options (``--convergence.KEY=VALUE``) from the command line,
changes a few of torchtitan's module attributes (convergence/backends/torchtitan/patches.py,
each with the versions it is for), then lets torchtitan parse the rest and train as usual.
After torchtitan's parallelisation of each model part the user's hook is applied
(``--convergence.hook``; convergence/backends/torchtitan/model_parts.py), and each step's data
fingerprint and per-part gradient norms are logged (``--convergence.log``;
convergence/backends/torchtitan/step_log.py).

The numerics probe (``--convergence.probe_step=K``: a job's request, convergence/run/probe.py)
is the wrapper's too (convergence/backends/torchtitan/probe.py), and a library override in the
``--key=true|false`` form becomes tyro's flag, placed before the activation-checkpoint
subcommand (tyro takes a parent's options only there).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergence.backends.torchtitan import anchors, patches, resume
from convergence.backends.torchtitan.argv import flag
from convergence.backends.torchtitan.converters import convert_model
from convergence.backends.torchtitan.model_parts import wrap_model_spec
from convergence.backends.torchtitan.probe import install_probe
from convergence.backends.torchtitan.step_log import StepLog
from convergence.spec.run_dir import anchor_of

PREFIX = "--convergence."
SUBCOMMAND_MARK = "activation-checkpoint:"


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The wrapper's own options (``--convergence.KEY=VALUE``; removed before torchtitan
    parses the command line)."""

    cpu: bool | None = None
    """Apply the CPU workarounds (gloo, eager attention, sum reduction); None: exactly when
    no CUDA device is available to this rank."""
    hook: str = ""
    """``package.module:function`` applied to each model part after parallelisation."""
    hook_mode: str = "after"
    """Only "after" exists for torchtitan jobs (the backend's preflight refuses others)."""
    log: str = ""
    """JSON-lines file (rank 0) for the data fingerprint and per-part gradient norms."""
    probe_step: int = 0
    """The numerics probe in place of this step (0: none)."""
    stop_after: int = 0
    """A resuming side's job 1: stop after this step, torchtitan's checkpoint of it written
    (0: train to the end; convergence/backends/torchtitan/resume.py)."""
    resume_from: str = ""
    """A resuming side's job 2: the checkpoint folder, checked before torchtitan loads it."""
    anchor_every: int = 0
    """The anchored check's control: save an anchor after every N-th step (0: none;
    convergence/backends/torchtitan/anchors.py)."""
    anchored_from: str = ""
    """The anchored job: the control's anchors folder, one step trained from each."""
    float8: str = ""
    """The pair's ``techniques.float8`` as torchtitan's float8 converter ("": off;
    convergence/backends/torchtitan/converters.py)."""
    mxfp8: bool = False
    """The pair's ``techniques.mxfp8`` as torchtitan's MXFP8 converter."""


def tyro_form(words: list[str]) -> list[str]:
    """``--a.b=true|false`` words as tyro's flags (``--a.b`` / ``--a.no-b``), moved before
    the activation-checkpoint subcommand when they came after it."""
    mark = next((i for i, w in enumerate(words) if w.startswith(SUBCOMMAND_MARK)), len(words))
    head: list[str] = []
    tail: list[str] = []
    for i, word in enumerate(words):
        key, sep, value = word.partition("=")
        if word.startswith("--") and sep and value in ("true", "false"):
            head.append(flag(key[2:], value == "true"))
        else:
            (head if i < mark else tail).append(word)
    return head + tail


def split_argv(argv: list[str]) -> tuple[LaunchOptions, list[str]]:
    """(our options, torchtitan's argv)."""
    ours: dict[str, Any] = {}
    rest: list[str] = []
    for word in argv:
        if not word.startswith(PREFIX):
            rest.append(word)
            continue
        key, sep, value = word[len(PREFIX) :].partition("=")
        if key in ("cpu", "mxfp8"):
            ours[key] = True
        elif key in ("hook", "hook_mode", "log", "resume_from", "anchored_from", "float8") and sep:
            ours[key] = value
        elif key in ("stop_after", "anchor_every", "probe_step") and sep and value.isdigit():
            ours[key] = int(value)
        else:
            raise SystemExit(
                f"the torchtitan launcher: unknown option {word!r} (use "
                f"{PREFIX}cpu, {PREFIX}hook=M:F, {PREFIX}hook_mode=after, "
                f"{PREFIX}log=PATH, {PREFIX}stop_after=K, {PREFIX}resume_from=DIR, "
                f"{PREFIX}anchor_every=N, {PREFIX}anchored_from=DIR, {PREFIX}probe_step=K, "
                f"{PREFIX}float8=RECIPE, {PREFIX}mxfp8)"
            )
    return LaunchOptions(**ours), tyro_form(rest)


def install(options: LaunchOptions) -> None:
    """Every change to torchtitan's modules, before its main() runs (SystemExit where the
    installed releases are not the ones the patches are for)."""
    refusal = patches.unsupported_releases()
    if refusal is not None:
        raise SystemExit(f"convergence.backends.torchtitan.launch: {refusal}")
    cpu = bool(options.cpu)
    if cpu:
        patches.pick_cpu_device()
    patches.patch_timeouts(cpu=cpu)
    patches.patch_pipeline_step()
    if cpu:
        patches.patch_attention()
    if options.log:
        patches.record_steps(StepLog(options.log))
    if options.probe_step:  # after record_steps: the probe sees the gradients first
        install_probe(options.probe_step)
    if options.stop_after:
        resume.stop_after(options.stop_after)
    if options.resume_from and anchor_of(Path(options.resume_from)):
        anchors.resume_from_anchor(options.resume_from)  # the anchored check's probe
    elif options.resume_from:
        resume.resume_from(options.resume_from)
    if options.anchor_every:
        anchors.save_anchors(options.anchor_every)
    if options.anchored_from:
        anchors.train_from_anchors(options.anchored_from)

    def on_config(config: Any) -> None:
        # The converters first: they rewrite the model config that the wrapped
        # parallelisation (and the user's hook) then sees built.
        convert_model(config, float8=options.float8, mxfp8=options.mxfp8, cpu=cpu)
        wrap_model_spec(config, cpu=cpu, hook=options.hook, hook_mode=options.hook_mode)

    patches.on_parsed_config(on_config)


def main(argv: list[str] | None = None, entry: Callable[[], None] | None = None) -> None:
    options, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    if options.cpu is None:
        import torch

        options = dataclasses.replace(options, cpu=not torch.cuda.is_available())
    sys.argv = [sys.argv[0], *rest]  # torchtitan's parser reads sys.argv
    install(options)
    if entry is None:
        from torchtitan.train import main as titan_main

        entry = titan_main
    entry()


if __name__ == "__main__":
    main()

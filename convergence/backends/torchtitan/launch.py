"""torchtitan's own training behind a thin wrapper: the entry point of every torchtitan job
(``torchrun ... -m convergence.backends.torchtitan.launch [ours] [theirs]``).

The wrapper removes its own options (``--convergence.KEY=VALUE``: ``LaunchOptions``) from the
command line, applies the shims the installed torch and torchtitan releases need
(convergence/backends/torchtitan/patches.py, each naming its versions), then runs torchtitan's
``main()`` (``patches.titan_main``) with our trainer class, ``ConvergenceTrainer``
(convergence/backends/torchtitan/trainer_class.py), which gets the options: the user's hook
after torchtitan's parallelisation of each part (``--convergence.hook``; model_parts.py), each
step's data fingerprint and per-part norms (``--convergence.log``; step_log.py), the numerics
probe (``--convergence.probe_step=K``; probe.py), a resume's two jobs (resume.py) and the
anchored check's (anchors.py).

A library override in the ``--key=true|false`` form becomes tyro's flag, placed before the
activation-checkpoint subcommand (tyro takes a parent's options only there).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from convergence.backends.torchtitan import patches
from convergence.backends.torchtitan.argv import flag
from convergence.backends.torchtitan.launch_options import LaunchOptions

PREFIX = "--convergence."
SUBCOMMAND_MARK = "activation-checkpoint:"


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
        if key in ("cpu", "mxfp8", "confirming_anchors"):
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
                f"{PREFIX}anchor_every=N, {PREFIX}confirming_anchors, "
                f"{PREFIX}anchored_from=DIR, {PREFIX}probe_step=K)"
            )
    return LaunchOptions(**ours), tyro_form(rest)


def install(options: LaunchOptions) -> None:
    """The version shims (patches.py), before torchtitan's trainer is imported (SystemExit
    where the installed releases are not the ones they are for). The features are no shims:
    they are ``ConvergenceTrainer``'s methods (trainer_class.py), chosen by ``options``."""
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


def main(argv: list[str] | None = None) -> None:
    options, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    if options.cpu is None:
        import torch

        options = dataclasses.replace(options, cpu=not torch.cuda.is_available())
    sys.argv = [sys.argv[0], *rest]  # torchtitan's parser reads sys.argv
    install(options)
    # After the shims: importing torchtitan's trainer makes its device choice.
    from convergence.backends.torchtitan.trainer_class import build_trainer

    patches.titan_main(lambda config: build_trainer(config, options))


if __name__ == "__main__":
    main()

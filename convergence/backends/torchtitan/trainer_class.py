"""``ConvergenceTrainer``: torchtitan's own ``Trainer``, with what a convergence job asks of it,
one override per place torchtitan 0.3's loop offers (the launcher builds it: launch.py, through
``patches.titan_main``, torchtitan's ``main()`` with our class).

Which features a job has is the launcher's typed ``LaunchOptions`` (its ``--convergence.*``
words); the order they act in is written here once, in these methods, whatever the job asks:

    __init__                the user's hook and the CPU reduction setting after torchtitan's
                            parallelisation of each part (the model spec wrapped before the
                            model is built: model_parts.py); then the step log's and the
                            probe's two listeners (the optimizers' post-step hook, the metrics
                            logger)
    train                   the anchored job's loop in place of torchtitan's (anchors.py); else
                            a resumed job's checks of its checkpoint or anchor (resume.py,
                            anchors.py), the anchor saves, the seed checkpoint for job 1 of a
                            resume -- then torchtitan's loop -- then job 1's manifest
    should_continue_training  the probe's step, a resume's job 1's stop, then torchtitan's
    train_step              the probe's recorder on the probed step; the step's line written
                            at its end (step_log.py)
    batch_generator         each batch into the data fingerprint
    forward_backward_step   the probed step's losses; after the step's last backward (its
                            gradients complete: torchtitan clips them next) the probe, then
                            the gradient norms and the parameters before the update
    (optimizers' post-step hook)  the update norms (torch's ``register_step_post_hook``)
    (metrics logger)        torchtitan's metrics line: the norm it clipped with, the replayed
                            losses of a probe, our norms added to its TensorBoard scalars

Why these places: torchtitan 0.3's ``train_step`` clips and steps inside one method and keeps
the norm it clipped with to itself until its metrics line; the method boundaries around it
(the last ``forward_backward_step``, the optimizers' step hook, the metrics logger) are where a
subclass sees a step without replacing torchtitan's code.

This module imports torchtitan's trainer: the launcher imports it after the version shims
(patches.py: the device choice is made when torchtitan's modules are first imported).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.metrics import BaseLogger
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from convergence.backends.torchtitan import anchors, resume
from convergence.backends.torchtitan.converters import convert_model
from convergence.backends.torchtitan.launch_options import LaunchOptions
from convergence.backends.torchtitan.model_parts import wrap_model_spec
from convergence.backends.torchtitan.probe import (
    TitanProbe,
    float32,
    holds_loss,
    start_recording,
    write_probe,
)
from convergence.backends.torchtitan.step_log import StepLog
from convergence.spec.run_dir import anchor_of

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class ConvergenceTrainer(Trainer):  # type: ignore[misc]  # torchtitan: untyped here
    """torchtitan's Trainer with the features ``options`` asks for (module docstring). It
    defines no ``Config`` of its own: the config stays the one torchtitan parsed."""

    def __init__(self, config: Trainer.Config, *, options: LaunchOptions) -> None:
        self.launch_options = options
        self.step_log = StepLog(options.log) if options.log else None
        self.titan_probe = TitanProbe(step=options.probe_step) if options.probe_step else None
        self.backwards_this_step = 0
        # The converters first: they rewrite the model config that the wrapped
        # parallelisation (and the user's hook) then sees built.
        convert_model(config, float8=options.float8, mxfp8=options.mxfp8, cpu=bool(options.cpu))
        wrap_model_spec(
            config, cpu=bool(options.cpu), hook=options.hook, hook_mode=options.hook_mode
        )
        super().__init__(config)
        self.named_params = [(n, p) for m in self.model_parts for n, p in m.named_parameters()]
        if self.step_log is not None:
            self.optimizers.register_step_post_hook(self._optimizers_stepped)
        if self.step_log is not None or self.titan_probe is not None:
            # A wrapper around torchtitan's loggers: sees each metrics line first.
            self.metrics_processor.logger = MetricsLine(self, self.metrics_processor.logger)
        logger.info("convergence: %s (%s)", type(self).__name__, ", ".join(self.features()))

    def features(self) -> list[str]:
        """The features this job asked for, by option name (the launcher's log line)."""
        o = self.launch_options
        asked = {
            "log": o.log,
            "hook": o.hook,
            "probe_step": o.probe_step,
            "stop_after": o.stop_after,
            "resume_from": o.resume_from,
            "anchor_every": o.anchor_every,
            "confirming_anchors": o.confirming_anchors,
            "anchored_from": o.anchored_from,
            "float8": o.float8,
            "mxfp8": o.mxfp8,
        }
        return [name for name, value in asked.items() if value] or ["none"]

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> None:
        options = self.launch_options
        if options.anchored_from:
            anchors.train_from_anchors(self, options.anchored_from)
            return
        if options.resume_from and anchor_of(Path(options.resume_from)):
            anchors.check_probe_anchor(self, options.resume_from)  # the anchored check's probe
        elif options.resume_from:
            resume.check_resume(self, options.resume_from)
        if options.anchor_every:
            anchors.save_anchors(self, options.anchor_every, options.confirming_anchors)
        if options.stop_after:
            resume.from_the_seed(self)
        super().train()
        if options.stop_after:
            resume.check_stopped(self, options.stop_after)

    def should_continue_training(self) -> bool:
        probe, stop = self.titan_probe, self.launch_options.stop_after
        if probe is not None and probe.done:
            return False
        if stop:  # a resume's job 1: up to its checkpoint (the LR schedule spans the run)
            return bool(self.step < min(stop, self.config.training.steps))
        return bool(super().should_continue_training())

    def probing(self) -> TitanProbe | None:
        """The probe, while the current step is the probed one and it is not written yet."""
        probe = self.titan_probe
        if probe is not None and self.step == probe.step and not probe.done:
            return probe
        return None

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        self.backwards_this_step = 0
        probe = self.probing()
        if probe is not None:
            start_recording(probe, self)
        try:
            super().train_step(data_iterator)
        finally:
            if probe is not None:
                probe.recorder.remove()
            if self.step_log is not None:
                self.step_log.write()

    # -- inside a step -------------------------------------------------------------------------

    def batch_generator(self, data_iterable: Iterable[Batch]) -> Iterator[Batch]:
        for input_dict, labels in super().batch_generator(data_iterable):
            if self.step_log is not None:
                self.step_log.on_batch(input_dict, labels)
            yield input_dict, labels

    def forward_backward_step(
        self,
        *,
        input_dict: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
        labels: torch.Tensor | list[torch.Tensor],
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        loss: torch.Tensor = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        probe = self.probing()
        if probe is not None:
            probe.losses.append(loss.detach())
        self.backwards_this_step += 1
        # torchtitan 0.3's train_step: one call per accumulation step, then it clips.
        if self.backwards_this_step == self.gradient_accumulation_steps:
            self.gradients_complete()
        return loss

    def gradients_complete(self) -> None:
        """The step's gradients as torchtitan is about to clip them: the probe first (it
        reads them, changes nothing), then the step log's norms."""
        probe = self.probing()
        if probe is not None:
            write_probe(probe, self)
            probe.done = True
        if self.step_log is not None:
            self.step_log.on_grads(self.named_params, self.parallel_dims, step=self.step)

    def _optimizers_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.step_log is not None
        self.step_log.on_stepped(self.named_params)

    def metrics_line(self, metrics: dict[str, Any], step: int) -> dict[str, Any]:
        """torchtitan's metrics line of a training step -> the line its loggers get."""
        probe = self.titan_probe
        if probe is not None and step < probe.step and holds_loss(self):
            probe.replayed[step] = float32(float(metrics["loss_metrics/global_avg_loss"]))
        log = self.step_log
        if log is not None and log.on_metrics(step, float(metrics["grad_norm"])):
            return {**metrics, **log.tensorboard_extras()}
        return metrics


class MetricsLine(BaseLogger):  # type: ignore[misc]
    """torchtitan's loggers (its ``LoggerContainer``) behind the trainer's ``metrics_line``:
    each training step's line (the one with ``grad_norm``; validation lines pass as they are)
    is shown to the trainer before torchtitan's loggers write it."""

    def __init__(self, trainer: ConvergenceTrainer, loggers: BaseLogger) -> None:
        self.trainer = trainer
        self.loggers = loggers

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if "grad_norm" in metrics:
            metrics = self.trainer.metrics_line(metrics, step)
        self.loggers.log(metrics, step)

    def close(self) -> None:
        self.loggers.close()


def trainer_class(config: Any) -> type[ConvergenceTrainer]:
    """Our class for a parsed config: torchtitan builds ``type(config)._owner``, ``Trainer``
    for the shipped experiments' ``Trainer.Config``; an experiment's own Trainer subclass gets
    ours on top of it (its overrides run inside ours)."""
    owner = getattr(type(config), "_owner", None)
    if owner is Trainer:
        return ConvergenceTrainer
    if isinstance(owner, type) and issubclass(owner, Trainer):
        return type(f"Convergence{owner.__name__}", (ConvergenceTrainer, owner), {})
    raise SystemExit(
        f"the torchtitan launcher: {type(config).__qualname__} builds {owner!r}, not a "
        "torchtitan Trainer: the launcher's trainer class extends torchtitan.trainer.Trainer"
    )


def build_trainer(config: Any, options: LaunchOptions) -> ConvergenceTrainer:
    return trainer_class(config)(config, options=options)

"""What the library asks of a job's trainer beyond "train the job": a typed request.

    anchor_every = N            save the whole training state after every N-th step
                                (the anchored check's control: convergence/checks/anchored.py)
    confirming_anchors = True   with anchor_every: also after each anchor's next step K+1
                                (the twin regime's confirming anchors: stats/anchored.py)
    anchored_from = F           train one step from each anchor in F (the anchored job)
    save_at = K, save_folder = F
                                checkpoint after step K into F and stop (a resuming side's
                                job 1: convergence/run/resume.py)
    resume_from = F             load the checkpoint F (job 1's folder, or one anchor
                                ``<anchors>/step<K>``) and train on (job 2, the resumed twins,
                                a probe from a checkpoint)
    probe_step = K              the numerics probe in place of step K (convergence/run/probe.py)

``JobSpec.request`` carries it; each backend turns it into its own command (the built-in
trainer's ``--checkpoint.*`` / ``--probe.*`` flags: backends/builtin.py; torchtitan's DCP
options and its launcher's: backends/torchtitan/anchors.py, resume.py, argv.py). A backend
that cannot do a part says so in its Capabilities and collection refuses the pair first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def saves_anchor_after(step: int, *, every: int, confirming: bool, steps: int) -> bool:
    """Whether a control asked for ``anchor_every = every`` (and ``confirming_anchors``) saves
    its state after ``step`` of a ``steps``-step run: after every ``every``-th step and, with
    ``confirming``, after each one's next step K+1 (K >= every); never after the last step (no
    step follows it to compare). Each trainer's saves follow this one rule (the built-in
    trainer: convergence/trainer/anchors.py; torchtitan: backends/torchtitan/anchors.py)."""
    if every <= 0 or step >= steps:
        return False
    return step % every == 0 or (confirming and step > every and (step - 1) % every == 0)


@dataclass(frozen=True, kw_only=True)
class TrainerRequest:
    """The parts the library asks for; the default (empty) request asks nothing."""

    anchor_every: int = 0
    """Save an anchor (the whole training state) after every N-th step but the last (0: none)."""
    confirming_anchors: bool = False
    """With ``anchor_every``: also save the state after each anchor's next step K+1, so that
    one step from it confirms (or not) an outright miss one step from K."""
    anchored_from: Path | None = None
    """The control's anchors folder: train one logged step from each anchor, nothing else."""
    save_at: int = 0
    """Checkpoint after this optimizer step into ``save_folder`` and stop (0: train on)."""
    save_folder: Path | None = None
    """Where ``save_at`` writes its checkpoint."""
    resume_from: Path | None = None
    """The checkpoint to load and train on from (a folder, or one anchor ``<anchors>/step<K>``)."""
    probe_step: int = 0
    """Run the numerics probe in place of this step (0: no probe)."""

    def __post_init__(self) -> None:
        for name in ("anchor_every", "save_at", "probe_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TrainerRequest.{name} must be an integer >= 0, got {value!r}")
        if bool(self.save_at) != (self.save_folder is not None):
            raise ValueError("TrainerRequest: save_at and save_folder go together")
        if self.confirming_anchors and not self.anchor_every:
            raise ValueError("TrainerRequest: confirming_anchors goes with anchor_every")
        if self.anchor_every and self.anchored_from is not None:
            raise ValueError("TrainerRequest: a job saves anchors or trains from them, not both")

    @property
    def empty(self) -> bool:
        return self == TrainerRequest()

    def as_overrides(self) -> tuple[tuple[str, str], ...]:
        """The request (but the probe) as the built-in trainer's ``section.key`` settings.

        Two readers: the built-in backend passes them as its flags, and the run-cache identity
        hashes them (JobSpec.identity) -- the request travelled as exactly these overrides,
        appended after the user's, before it had a type, so no job's key changed with it. The
        probe was never an override (a probe's key is its own: run/probe.py cached_probe).
        """
        out: list[tuple[str, str]] = []
        if self.anchor_every:
            out.append(("checkpoint.anchor_every", str(self.anchor_every)))
        if self.confirming_anchors:  # absent otherwise: the plain controls keep their keys
            out.append(("checkpoint.confirming_anchors", "true"))
        if self.anchored_from is not None:
            # One logged step after each anchor, no validation pass: the control's anchored
            # steps are compared on the training metrics.
            out += [
                ("checkpoint.anchored_from", str(self.anchored_from)),
                ("metrics.log_freq", "1"),
                ("metrics.val_every", "0"),
            ]
        if self.save_at:
            out += [
                ("checkpoint.save_at_step", str(self.save_at)),
                ("checkpoint.save_folder", str(self.save_folder)),
            ]
        if self.resume_from is not None:
            out.append(("checkpoint.resume_from", str(self.resume_from)))
        return tuple(out)

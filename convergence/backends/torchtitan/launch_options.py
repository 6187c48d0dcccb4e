"""The torchtitan launcher's own options (``--convergence.KEY=VALUE``: launch.py parses them)
as one typed value, which the launcher's trainer class receives (trainer_class.py): which
features a job has. A module of its own: both import it, neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass


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
    confirming_anchors: bool = False
    """With ``anchor_every``: also save after each anchor's next step (the twin regime's
    confirming anchors)."""
    anchored_from: str = ""
    """The anchored job: the control's anchors folder, one step trained from each."""
    float8: str = ""
    """The pair's ``techniques.float8`` as torchtitan's float8 converter ("": off;
    convergence/backends/torchtitan/converters.py)."""
    mxfp8: bool = False
    """The pair's ``techniques.mxfp8`` as torchtitan's MXFP8 converter."""

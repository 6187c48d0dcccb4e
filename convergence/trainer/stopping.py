"""The save and stop steps: after each optimizer step, whether the run saves its state and
whether it ends there.

A run ends early in two ways: at its checkpoint step (checkpoint.save_at_step: it writes the
training checkpoint a resume starts from, then stops as an interrupted job would), or when it
is asked to stop (SIGTERM, or the STOP file the launcher writes in the dump folder). Every
rank takes the same decision at the same step, so none is left waiting in a collective.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from convergence.spec.run_dir import DumpDir
from convergence.trainer import anchors, resume
from convergence.trainer.metrics_writer import RunStatus


class StopSignal:
    """Set by SIGTERM or by the STOP file; agreed by all ranks so none is left in a collective."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file
        self.sigterm = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm = True

    def should_stop(self, distributed: bool, device: torch.device) -> bool:
        rank0 = not distributed or dist.get_rank() == 0
        local = self.sigterm or (rank0 and self.stop_file.exists())
        if not distributed:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


class SaveAndStop:
    """What happens after each step besides training: the one place where the loop saves
    state or ends early (a save that lets the run go on belongs here too)."""

    def __init__(self, run: resume.Checkpointable, *, distributed: bool) -> None:
        self.run = run
        self.distributed = distributed
        self.signal = StopSignal(DumpDir(Path(run.cfg.metrics.dump_folder)).stop)

    def after(self, step: int, position: resume.RunPosition) -> RunStatus | None:
        """Save and stop steps after optimizer step `step` (the run at `position`): the
        status the run ends with there, or None to go on."""
        checkpoint = self.run.cfg.checkpoint
        if anchors.saves_anchor(self.run.cfg, step):  # a control's anchor: save and go on
            anchors.save_anchor(self.run, step, position)
        if step == checkpoint.save_at_step:
            # Stop here as an interrupted job would, leaving everything a resume needs.
            resume.save_training_checkpoint(
                checkpoint.save_folder, self.run, position.state_at(step)
            )
            return "checkpointed"
        if self.signal.should_stop(self.distributed, self.run.device):
            return "stopped"
        return None

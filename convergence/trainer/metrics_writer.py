"""Metrics of one run: metrics.jsonl (read live by the launcher), TensorBoard, run_meta.json.

Only the rank holding the loss writes (global rank 0, or the first rank of the last PP stage);
every other rank gets a writer that does nothing, so the loop has no `if rank == ...` noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from convergence.spec.run_dir import DumpDir

RunStatus = Literal["running", "finished", "checkpointed", "stopped", "failed"]
"""run_meta.json's ``status``: still training, done, stopped after writing the training
checkpoint (checkpoint.save_at_step), stopped early by the launcher (STOP file), or failed."""

#: TensorBoard tags, named as torchtitan names them so users can read both.
TB_TAGS: dict[str, str] = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "grad_norm_parts": "grad_norm_parts",
    "update_norm": "update_norm",
    "update_norm_parts": "update_norm_parts",
    "lr": "lr",
    "tokens_per_s": "throughput(tps)",
    "peak_mem_mib": "memory/max_reserved(MiB)",
    "val_loss": "validation_metrics/loss",
    # MoE models only (trainer/moe.py: StepRouting.metrics).
    "moe_aux_loss": "moe/aux_loss",
    "moe_load_max": "moe/load_max",
}


class MetricsWriter:
    def __init__(self, folder: str | Path, *, enabled: bool, tensorboard: bool) -> None:
        self.folder = Path(folder)
        self.files = DumpDir(self.folder)
        self.enabled = enabled
        self._jsonl = None
        self._tb: Any = None
        if not enabled:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.files.metrics, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.files.tensorboard))

    def log(self, record: dict[str, float | int]) -> None:
        """One JSON line per logged step, flushed and fsynced: the launcher reads it live."""
        if not self.enabled or self._jsonl is None:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())
        if self._tb is not None:
            step = int(record["step"])
            for key, tag in TB_TAGS.items():
                if key in record:
                    # double_precision + new_style: the event stores the exact float64.
                    self._tb.add_scalar(
                        tag, float(record[key]), step, new_style=True, double_precision=True
                    )
            self._tb.flush()

    def write_meta(self, meta: dict[str, Any]) -> None:
        """run_meta.json, replaced atomically so a reader never sees half a file."""
        if not self.enabled:
            return
        tmp = self.files.run_meta.with_name(self.files.run_meta.name + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.files.run_meta)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

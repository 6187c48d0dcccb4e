"""The nightly scalars as TensorBoard runs: ``<out>/<pair>/events.out.tfevents.*``.

Why: teams already watch training in TensorBoard; one run per pair puts every pair's nights
side by side there (``tensorboard --logdir DIR/tensorboard``) with smoothing, zoom and
run filters for free. Tags (see :data:`SCALARS`): ``nightly/final_loss_delta``,
``nightly/control_final_loss``, ``nightly/step_time_s``, ``nightly/control_step_time_s``,
``nightly/tokens_per_s``, ``nightly/control_tokens_per_s``, ``nightly/peak_mem_mib`` and
``nightly/passed`` (1 passed, 0 failed or error; absent when skipped).

The step is the night's index in the history (0 for the first night), the wall time the
night's start when its name or report says it (convergence.nightly.history.NightRecord).
Values are written as float64 tensors (``double_precision``), so they read back exactly
(convergence.metrics.tensorboard reads every record at full precision). A night a pair did
not run, or a value it lacked, writes nothing: TensorBoard draws the nights on either side.

The trend is rewritten from the whole history after each night, so the event files this module
wrote before are removed first; otherwise TensorBoard would show every night once per rewrite.
torch's ``SummaryWriter`` is imported lazily (torch is heavy).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

TAG_PREFIX = "nightly/"
#: Series of the trend written as scalars (``nightly/<name>``).
SCALARS: tuple[str, ...] = (
    "final_loss_delta",
    "control_final_loss",
    "step_time_s",
    "control_step_time_s",
    "tokens_per_s",
    "control_tokens_per_s",
    "peak_mem_mib",
    "passed",
)
EVENT_GLOB = "events.out.tfevents.*"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")


def run_names(pairs: Sequence[str]) -> dict[str, str]:
    """A folder name per pair id: ``file.toml::name`` -> ``file.toml_name``; two ids that
    would share a name (or one that leaves nothing) get a short hash of the id appended."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    for pair in sorted(pairs):
        name = _UNSAFE.sub("_", pair).strip("._") or "pair"
        if name in taken:
            name = f"{name}-{hashlib.sha1(pair.encode()).hexdigest()[:8]}"
        taken.add(name)
        names[pair] = name
    return names


def _clear(root: Path) -> None:
    """Remove the event files of earlier exports (and run folders left empty)."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        for events in folder.glob(EVENT_GLOB):
            events.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()


def export_tensorboard(
    nights: Sequence[str],
    night_times: Sequence[float | None],
    series: Mapping[str, Mapping[str, Sequence[float | None]]],
    root: Path,
) -> dict[str, Path]:
    """Write one TensorBoard run per pair under ``root``; returns pair -> its folder."""
    from torch.utils.tensorboard import SummaryWriter

    _clear(root)
    folders = {pair: root / name for pair, name in run_names(list(series)).items()}
    for pair, folder in folders.items():
        writer = SummaryWriter(log_dir=str(folder))
        try:
            for metric in SCALARS:
                values = series[pair].get(metric) or []
                for step, value in enumerate(values[: len(nights)]):
                    if value is None:
                        continue
                    wall = night_times[step] if step < len(night_times) else None
                    writer.add_scalar(
                        TAG_PREFIX + metric,
                        float(value),
                        global_step=step,
                        walltime=wall,
                        new_style=True,
                        double_precision=True,
                    )
        finally:
            writer.close()
    return folders

"""Training checkpoints: stop after step K, resume on the same or on another layout.

A resume is right when the resumed run continues the uninterrupted one exactly: the same
weights, the same AdamW moments, the same point of the LR schedule, the next unread sample and
the same RNG stream. Each of those is a piece of state that a real resume bug drops (the
optimizer rebuilt empty, the scheduler started again, the loader back at sample 0, the
generator reseeded), so each is saved and restored explicitly, by its own function below --
which is also where the planted resume bugs of benchmarks/detection replace one.

Written with torch.distributed.checkpoint (DCP) from *sharded* state dicts: every rank writes
only the slices it holds (a DTensor's local shard) and the .metadata file records each
tensor's global shape and the chunks it was cut into. Loading asks for the slices of the new
layout's DTensors, and DCP reads whichever stored chunks overlap them. That is how a checkpoint
written under FSDP2 loads into FSDP2+TP2, or one from HSDP into FSDP+PP (resharding), without
gathering the whole model on any rank.

Contents, keyed by the model's fully qualified names (the same in every layout: PP chunks keep
the global layer names, see pipeline.split_model_for_pp):

    model.<fqn>                         parameters (DTensor shards)
    optim.<fqn>.exp_avg / .exp_avg_sq   AdamW's moments, sharded like their parameter
    optim.<fqn>.step                    AdamW's step count (its bias correction)
    train.step                          the last optimizer step taken
    train.data_position                 global index of the next unread training sample
    train.lr_step                       the LR schedule's position (its last step)
    rng.torch [, rng.cuda]              the generator states

plus resume.json (rank 0): what the checkpoint was trained for -- model, data, optimizer,
schedule, seed, steps, global batch --, checked against the resuming job before anything is
loaded, so that a checkpoint of another model or another data order is an error naming it and
the key that differs, never a silent fresh start or a run that quietly trains something else.

The loop asks this module where it starts (:func:`start_position`: step 1, or the step after a
loaded checkpoint's) and what a checkpoint of step s holds of its progress
(:meth:`RunPosition.state_at`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from convergence.trainer.config import TrainConfig
from convergence.trainer.data import BatchPlan

MANIFEST = "resume.json"
#: Bumped when the contents change; a checkpoint of another format is refused.
FORMAT = 1
#: AdamW's per-parameter state (torch.optim.AdamW without amsgrad).
MOMENTS = ("exp_avg", "exp_avg_sq")


class ResumeError(RuntimeError):
    """A training checkpoint that cannot serve this resume. One line: the checkpoint, what is
    wrong, the fix (the launcher quotes a rank's last traceback line)."""

    def __init__(self, folder: str | Path, problem: str, fix: str) -> None:
        super().__init__(f"checkpoint {folder} cannot serve this resume: {problem} (fix: {fix})")


@dataclass(frozen=True, kw_only=True)
class TrainState:
    """Where a run stands after an optimizer step (what the loop needs to go on)."""

    step: int
    """The last optimizer step taken (1-based)."""
    data_position: int
    """Global index of the next training sample to read (data.BatchPlan)."""
    lr_step: int
    """The step the LR schedule last answered for (optim.lr_at)."""


@dataclass(frozen=True, kw_only=True)
class Checkpointable:
    """This rank's share of a run, as a training checkpoint saves and a resume restores it,
    and the job it belongs to (what a checkpoint is checked against before it is loaded)."""

    chunks: Sequence[nn.Module]
    named_params: Sequence[tuple[str, nn.Parameter]]
    """The chunks' parameters by FQN: the optimizer state is keyed by these names."""
    optimizer: torch.optim.Optimizer
    cfg: TrainConfig
    global_batch_size: int
    device: torch.device


def manifest(cfg: TrainConfig, state: TrainState, global_batch_size: int) -> dict[str, Any]:
    """What a checkpoint was trained for; resume.json."""
    sections = cfg.to_dict()
    return {
        "format": FORMAT,
        "step": state.step,
        "global_batch_size": global_batch_size,
        "model": sections["model"],
        "data": sections["data"],
        "optimizer": sections["optimizer"],
        "lr_scheduler": sections["lr_scheduler"],
        "training": {"seed": cfg.training.seed, "steps": cfg.training.steps},
        "parallelism": sections["parallelism"],
    }


# ----------------------------------------------------------------------------------------------
# Save


def model_state(chunks: Sequence[nn.Module]) -> dict[str, Any]:
    """The sharded model state of this rank's chunks (disjoint names under PP), by FQN."""
    state: dict[str, Any] = {}
    for chunk in chunks:
        state.update(get_model_state_dict(chunk))
    return state


def optimizer_state(
    named_params: Sequence[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """AdamW's state per parameter FQN: the moments (DTensors sharded like the parameter,
    so DCP reshards them with it) and the step count (a plain tensor, equal on every rank)."""
    out: dict[str, Any] = {}
    for name, param in named_params:
        state = optimizer.state.get(param)
        if not state:
            raise RuntimeError(
                f"parameter {name} has no optimizer state at checkpoint time "
                "(no gradient yet?): a checkpoint before step 1 is not a resume"
            )
        out[name] = {
            "step": torch.as_tensor(state["step"]).detach().clone().float(),
            **{key: state[key] for key in MOMENTS},
        }
    return out


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generator states. Every rank seeds alike and nothing rank-specific draws from the
    generator, so rank 0's state (DCP keeps one copy of a plain tensor) is every rank's."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_training_checkpoint(folder: str | Path, run: Checkpointable, state: TrainState) -> None:
    """Write the training checkpoint of this rank's shards (every rank calls it)."""
    folder = Path(folder)
    model = model_state(run.chunks)
    names = {name for name, _ in run.named_params}
    # Persistent buffers (an MoE router's expert_bias) are model state without an optimizer
    # state: saved with the model, left out of the pairing.
    buffers = {name for chunk in run.chunks for name, _ in chunk.named_buffers()}
    if names != set(model) - buffers:
        # The optimizer state is keyed by named_parameters(), the model by the state dict's
        # FQNs; they must be the same names or the resume could not pair them up again.
        raise RuntimeError(
            f"parameter names differ from the model state dict's: {sorted(names ^ set(model))[:4]}"
        )
    dcp.save(
        {
            "model": model,
            "optim": optimizer_state(run.named_params, run.optimizer),
            "train": {
                "step": torch.tensor(state.step),
                "data_position": torch.tensor(state.data_position),
                "lr_step": torch.tensor(state.lr_step),
            },
            "rng": rng_state(run.device),
        },
        checkpoint_id=str(folder),
    )
    # The manifest last: a folder with resume.json holds a complete checkpoint.
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = json.dumps(manifest(run.cfg, state, run.global_batch_size), indent=2, sort_keys=True)
        (folder / MANIFEST).write_text(text + "\n")
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# Load: check first (clear errors), then restore each piece of state


def _differences(saved: Any, wanted: Any, prefix: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(wanted, dict):
        out: list[str] = []
        for key in sorted(set(saved) | set(wanted)):
            out += _differences(saved.get(key), wanted.get(key), f"{prefix}.{key}")
        return out
    return [] if saved == wanted else [f"{prefix}: checkpoint {saved!r}, this job {wanted!r}"]


def check_servable(
    folder: str | Path, cfg: TrainConfig, global_batch_size: int, template: dict[str, Any]
) -> dict[str, Any]:
    """Raise ResumeError unless the checkpoint in `folder` can continue this job: complete
    (resume.json, .metadata, every shard file), for the same model, data, optimizer, schedule,
    seed, steps and global batch, holding every tensor of `template` at the same global
    shape, and stopped before the job's last step. Returns its manifest."""
    folder = Path(folder)
    fix_rerun = "run the job that writes it again (checkpoint.save_at_step)"
    if not folder.is_dir():
        raise ResumeError(folder, "the folder does not exist", fix_rerun)
    if not (folder / ".metadata").is_file() or not (folder / MANIFEST).is_file():
        raise ResumeError(
            folder,
            f"no {'.metadata' if (folder / MANIFEST).is_file() else MANIFEST}"
            " (not a training checkpoint, or its save did not finish)",
            fix_rerun,
        )
    saved = json.loads((folder / MANIFEST).read_text())
    if saved.get("format") != FORMAT:
        raise ResumeError(
            folder, f"format {saved.get('format')!r}, this trainer reads {FORMAT}", fix_rerun
        )
    wanted = manifest(cfg, TrainState(step=0, data_position=0, lr_step=0), global_batch_size)
    differ = []
    for section in ("model", "data", "optimizer", "lr_scheduler", "training", "global_batch_size"):
        differ += _differences(saved.get(section), wanted[section], section)
    if differ:
        raise ResumeError(
            folder,
            "it was trained for another job: " + "; ".join(differ[:4]),
            "resume with the model, data, optimizer, schedule, seed, steps and "
            "tokens per step the checkpoint was written with",
        )
    step = int(saved["step"])
    if not 1 <= step < cfg.training.steps:
        raise ResumeError(
            folder,
            f"it stopped at step {step}, this job ends at step {cfg.training.steps}",
            "resume only from a step inside the run",
        )
    metadata = FileSystemReader(str(folder)).read_metadata()
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ResumeError(
            folder, f"shard file(s) {', '.join(missing)} missing (of {len(files)})", fix_rerun
        )
    stored = metadata.state_dict_metadata
    for key, value in template.items():
        if key not in stored:
            raise ResumeError(folder, f"it holds no {key!r}", fix_rerun)
        size = getattr(stored[key], "size", None)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        if size is not None and shape is not None and tuple(size) != shape:
            raise ResumeError(
                folder,
                f"{key!r} has shape {tuple(size)} there, {shape} here",
                "resume with the model the checkpoint was written with",
            )
    return saved


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def restore_model(chunks: Sequence[nn.Module], loaded: dict[str, Any]) -> None:
    """The loaded shards into each chunk (its own names only)."""
    for chunk in chunks:
        own = get_model_state_dict(chunk)
        set_model_state_dict(chunk, {name: loaded[name] for name in own})


def restore_optimizer(
    named_params: Sequence[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    loaded: dict[str, Any],
) -> None:
    """AdamW's moments and step count, as if the optimizer had taken the saved steps itself.
    Without them the first step after the resume is Adam's first step again (bias correction
    of step 1: a full-size update in the gradient's sign) -- the curve jumps right there."""
    for name, param in named_params:
        entry = loaded[name]
        optimizer.state[param] = {
            "step": entry["step"].clone(),
            **{key: entry[key] for key in MOMENTS},
        }


def restore_lr_step(state: TrainState) -> int:
    """The schedule's position: the loop asks lr_at for step + (lr_step - step)."""
    return state.lr_step


def restore_data_position(state: TrainState) -> int:
    """The next unread sample: the loop shifts its batch plan by position - step * B."""
    return state.data_position


def restore_rng(loaded: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(loaded["torch"])
    if "cuda" in loaded and device.type == "cuda":
        torch.cuda.set_rng_state(loaded["cuda"], device)


def load_training_checkpoint(folder: str | Path, run: Checkpointable) -> TrainState:
    """Check the checkpoint, then load this layout's slices of it into the model and the
    optimizer (the new layout decides the slices: resharding); return the state to go on from.
    Every rank calls it."""
    model = model_state(run.chunks)
    optim = {
        name: {
            "step": torch.zeros(()),
            **{key: torch.zeros_like(param).detach() for key in MOMENTS},
        }
        for name, param in run.named_params
    }
    train = {"step": torch.tensor(0), "data_position": torch.tensor(0), "lr_step": torch.tensor(0)}
    rng = {"torch": torch.get_rng_state()}
    state = {"model": model, "optim": optim, "train": train, "rng": rng}
    check_servable(folder, run.cfg, run.global_batch_size, _flatten(state))
    # The CUDA generator only where both runs had one (a CPU checkpoint resumed on a GPU keeps
    # the GPU's seeded generator: nothing drew from the CPU run's, there was none).
    if (
        run.device.type == "cuda"
        and "rng.cuda" in FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    ):
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    dcp.load(state, checkpoint_id=str(folder))
    restore_model(run.chunks, model)
    restore_optimizer(run.named_params, run.optimizer, optim)
    restore_rng(rng, run.device)
    saved = TrainState(
        step=int(train["step"]),
        data_position=int(train["data_position"]),
        lr_step=int(train["lr_step"]),
    )
    return TrainState(
        step=saved.step, data_position=restore_data_position(saved), lr_step=restore_lr_step(saved)
    )


# ----------------------------------------------------------------------------------------------
# The loop's position: where it starts, and where the LR schedule and the data stand at a step


@dataclass(frozen=True, kw_only=True)
class RunPosition:
    """Where the loop starts, and the LR schedule's and the data's positions at each step.

    A resume (checkpoint.resume_from) continues a run that stopped after step K, possibly
    under another layout: weights and AdamW moments are loaded as this layout's shards, and
    the loop goes on from K+1 at the saved data position and schedule position. Those two
    are kept as offsets from the step count -- zero in a correct resume -- so a checkpoint
    that put them elsewhere is followed, not silently corrected.
    """

    first_step: int
    lr_offset: int
    """The LR schedule's position minus the step count."""
    plan: BatchPlan
    """The batch plan of the training samples, shifted by the data offset (BatchPlan.offset)."""

    def lr_step(self, step: int) -> int:
        """The step the LR schedule answers for at optimizer step `step`."""
        return step + self.lr_offset

    def state_at(self, step: int) -> TrainState:
        """Where the run stands after `step`: what a training checkpoint saves."""
        return TrainState(
            step=step,
            lr_step=self.lr_step(step),
            data_position=self.plan.offset + step * self.plan.global_batch_size,
        )


def start_position(run: Checkpointable, plan: BatchPlan) -> RunPosition:
    """Step 1 of a fresh run, or the step after a resumed checkpoint's (loaded into `run`)."""
    folder = run.cfg.checkpoint.resume_from
    if not folder:
        return RunPosition(first_step=1, lr_offset=0, plan=plan)
    restored = load_training_checkpoint(folder, run)
    return RunPosition(
        first_step=restored.step + 1,
        lr_offset=restored.lr_step - restored.step,
        plan=replace(plan, offset=restored.data_position - restored.step * plan.global_batch_size),
    )

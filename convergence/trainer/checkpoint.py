"""The seed checkpoint: identical starting weights for every layout of a comparison.

Created once by a single process (the full model on CPU, seeded, initialised) with
torch.distributed.checkpoint; every layout then loads it into its *sharded* state dict, so each
rank reads only the slices it owns and control and test start bit-identical whatever their
sharding. Without a seed checkpoint the trainer does the same from an in-memory full model
built from training.seed, which gives the same weights as a seed checkpoint of that seed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from convergence.trainer.model import ModelArgs, Transformer, build_model

HASH_FILE = "sha256.txt"


def full_model(args: ModelArgs, seed: int) -> Transformer:
    """The whole model on CPU, initialised from `seed` (same values on every rank)."""
    model = build_model(args, "cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """Content hash of a state dict: names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def create_seed_checkpoint(args: ModelArgs, seed: int, folder: str | Path) -> str:
    """Write the seed checkpoint of `seed` into `folder` (one process); return its sha256."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = full_model(args, seed).state_dict()
    dcp.save(state, checkpoint_id=str(folder))
    sha = state_dict_sha256(state)
    (folder / HASH_FILE).write_text(sha + "\n")
    return sha


def checkpoint_sha256(folder: str | Path) -> str:
    """The recorded content hash, or a hash of the folder's files if none was recorded."""
    folder = Path(folder)
    recorded = folder / HASH_FILE
    if recorded.is_file():
        return recorded.read_text().strip()
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def load_seed_checkpoint(model: nn.Module, folder: str | Path) -> None:
    """Load into a (possibly sharded, possibly PP-chunked) model: each rank reads its slices."""
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state)


@torch.no_grad()
def load_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict (identical on every rank) into a sharded model, no communication.

    Each DTensor takes its local slice of the full tensor (src_data_rank=None: no broadcast,
    every rank already has the same full values).
    """
    state = get_model_state_dict(model)
    for name, target in state.items():
        source = full[name]
        if isinstance(target, DTensor):
            source = source.to(device=target.to_local().device, dtype=target.dtype)
            local = distribute_tensor(
                source, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(source)
    set_model_state_dict(model, state, options=StateDictOptions(strict=True))

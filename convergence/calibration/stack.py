"""The stack a calibration is valid for: hardware, torch, accelerator stack, numerics env.

The same facts as the run cache's key (cache/key.py, cache/stack.py) minus the code: floors
measured on an A100 with CUDA 12.4 say nothing about an H100, nor about the same GPU after an
NCCL upgrade (another all-reduce order), nor about CPU runs with more OpenMP threads (another
split of every reduction). The trainer's sources are left out on purpose: a code change is what
a pair is for, and must not throw the floors away.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from convergence.cache.key import canonical_json, hardware_fingerprint
from convergence.cache.stack import accelerator_stack, numerics_env
from convergence.torch_info import torch_version


def job_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment jobs start with, as the numerics see it: one OpenMP thread unless set
    (launch/torchrun.job_env; the Runner's cache key reads it the same way)."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def current_stack(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This machine's stack: ``{"hardware", "torch", "accelerator", "env"}`` (imports torch
    where importable, as the run cache's key does)."""
    return {
        "hardware": hardware_fingerprint(),
        "torch": torch_version(),
        "accelerator": accelerator_stack(),
        "env": numerics_env(job_environ(environ)),
    }


def stack_hash(stack: Mapping[str, Any]) -> str:
    """16 hex digits naming ``stack`` (the calibration file's name)."""
    return hashlib.sha256(canonical_json(dict(stack)).encode()).hexdigest()[:16]


def stack_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``["torch 2.5.1 -> 2.13.0", ...]``: what differs between two stacks, for the note that
    says why a calibration was not used."""
    out = []
    for key in sorted(set(recorded) | set(current)):
        if recorded.get(key) != current.get(key):
            out.append(f"{key} {recorded.get(key)!r} -> {current.get(key)!r}")
    return out

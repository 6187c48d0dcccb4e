"""Cache keys: a sha256 over everything that decides a run's curves.

The key covers the job's identity (layout, steps, seed, hook, overrides, ...), the training
config's text, the backend's version, the convergence package's own sources (editing the
trainer invalidates every entry), torch's version and the hardware (kernels and reduction
order differ between CPU models and GPU types, and curves are compared at the noise floor).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convergence.torch_info import may_see_gpus

KEY_SCHEMA = 1
"""Bump when the meaning of a key changes: every existing entry then misses."""

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def _canonical(value: Any, where: str) -> Any:
    """A JSON-able, order-independent form of ``value``; a clear error for anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v, f"{where}{{}}") for v in value)
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"cache key: {where} is {value}, which has no canonical JSON form")
        return value
    raise TypeError(
        f"cache key: {where} has type {type(value).__name__}, which cannot be "
        "hashed canonically; pass str/int/float/bool/None, lists, dicts, Paths "
        "or dataclasses of those"
    )


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, UTF-8: the same data always gives the same text."""
    return json.dumps(
        _canonical(value, "job"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def cache_key(
    job_identity: Mapping[str, Any],
    *,
    train_config_text: str,
    backend_version: str,
    code_version: str,
    torch_version: str,
    hardware: str,
) -> str:
    """The hex sha256 naming a run in the :class:`~convergence.cache.store.RunCache`."""
    payload = {
        "schema": KEY_SCHEMA,
        "job": job_identity,
        "train_config_sha256": hashlib.sha256(train_config_text.encode()).hexdigest(),
        "backend_version": backend_version,
        "code_version": code_version,
        "torch_version": torch_version,
        "hardware": hardware,
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


def sources_hash(root: Path) -> str:
    """sha256 over every ``.py`` file under ``root`` (relative path + content, sorted)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


#: The parts of the package that decide what a run computes. Editing the statistics, the
#: reports or the plugin must not throw away every cached control run; editing the trainer,
#: the rank-side code both trainers run (rank/: norms, sample hash, probe, hooks, rounding
#: draw) or how a job becomes a command must (tests/test_layers.py: what the trainers import).
RESULT_PACKAGES: tuple[str, ...] = ("trainer", "backends", "rank")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the sources that decide a run's result (computed once per process)."""
    return hashlib.sha256(
        "".join(sources_hash(_PACKAGE_ROOT / name) for name in RESULT_PACKAGES).encode()
    ).hexdigest()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def hardware_fingerprint() -> str:
    """``cuda:<gpu names>`` when torch sees GPUs, else ``cpu:<model> x<count> (<arch>)``.

    torch is only consulted when it may see a GPU (:func:`convergence.torch_info.may_see_gpus`:
    importing it costs seconds) and is importable; the result is cached per process.
    """
    if may_see_gpus():  # False: hidden by CUDA_VISIBLE_DEVICES, or a CPU-only build
        try:
            torch = sys.modules.get("torch") or __import__("torch")
            if torch.cuda.is_available():
                names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                return "cuda:" + ",".join(sorted(names))
        except ImportError:
            pass
    return f"cpu:{_cpu_model()} x{os.cpu_count()} ({platform.machine()})"

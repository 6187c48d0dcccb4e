"""The accelerator stack and the numerics-relevant environment, for cache keys.

A cached control is only a valid reference while everything that decides its numbers is
unchanged. Besides torch and the device model (convergence.cache.key), that is the rest of
the stack -- CUDA runtime, cuDNN, NCCL (or ROCm/RCCL) and the driver -- and environment
variables that change kernels or reduction order: NCCL's algorithm/protocol/channel choices
pick another summation order for every all-reduce, ``CUBLAS_WORKSPACE_CONFIG`` and the TF32
overrides pick other GEMM kernels, and on CPU the thread counts split reductions differently.
Without them in the key, a nightly would reuse last week's control after a driver or NCCL
upgrade and its trend could never show the stack drifting.

Only what is present is recorded (a CPU machine's fingerprint names no CUDA), and nothing here
imports torch unless it is already imported or importable.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convergence.torch_info import torch_build

NUMERICS_ENV: tuple[str, ...] = (
    # NCCL: which algorithm, protocol and how many channels/threads reduce (summation order).
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_NTHREADS",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_TREE_THRESHOLD",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_DISABLE",
    "NCCL_CROSS_NIC",
    "NCCL_ALGO_TUNER",
    "NCCL_TUNER_PLUGIN",
    # cuBLAS / cuDNN / TF32: kernel choice and precision of matmuls and convolutions.
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_CUDNN_V8_API_DISABLED",
    "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT",
    "CUDA_LAUNCH_BLOCKING",
    # torch: determinism and the CPU kernel family.
    "CUBLAS_DETERMINISTIC",
    "TORCH_DETERMINISTIC",
    "ATEN_CPU_CAPABILITY",
    # CPU threads: how many pieces a reduction is split into.
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    # Gloo's allreduce algorithm (the CPU collectives of these tests).
    "GLOO_ALGORITHM",
    # Another machine's rounding, emulated (convergence/rank/rounding_draw.py).
    "CONVERGENCE_ROUNDING_DRAW",
)
"""Environment variables that change the numbers a run produces (set ones are keyed)."""


def numerics_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The set :data:`NUMERICS_ENV` variables and their values."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in NUMERICS_ENV if name in env}


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version line (no nvidia-smi process needed)."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return " ".join(first.split()[:8])


def accelerator_stack() -> dict[str, Any]:
    """CUDA/HIP runtime, cuDNN, NCCL and driver versions, where present."""
    stack: dict[str, Any] = {}
    build = torch_build()
    if "torch" not in sys.modules and build is not None and not build.has_gpu:
        # A CPU-only build has no CUDA, HIP, cuDNN or NCCL to report: the same dict as below,
        # told from torch's version.py instead of an import that costs the pytest process ~3 s
        # of CPU before its first job.
        driver = _driver_version()
        return {"driver": driver} if driver is not None else {}
    try:
        torch = sys.modules.get("torch") or __import__("torch")
    except ImportError:
        return stack
    stack["cuda"] = torch.version.cuda
    stack["hip"] = getattr(torch.version, "hip", None)
    try:
        stack["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
    except (RuntimeError, AttributeError):
        stack["cudnn"] = None
    try:
        stack["nccl"] = (
            ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        )
    except (RuntimeError, AttributeError, TypeError):
        stack["nccl"] = None
    stack["driver"] = _driver_version()
    return {k: v for k, v in stack.items() if v is not None}


@functools.lru_cache(maxsize=1)
def _stack_text() -> str:
    return json.dumps(accelerator_stack(), sort_keys=True, separators=(",", ":"))


def stack_fingerprint(environ: Mapping[str, str] | None = None) -> str:
    """One string for the cache key: the stack (computed once per process) and the numerics
    environment (read each time: a session may change it between pairs)."""
    env = json.dumps(numerics_env(environ), sort_keys=True, separators=(",", ":"))
    return f"stack={_stack_text()} env={env}"

"""Low-precision linears (the ``[precision]`` section): float8 and MXFP8 training via torchao.

    [precision]
    float8 = "tensorwise"        # or "rowwise"; "none" = off
    float8_all_gather = true     # FSDP2 all-gathers the float8 weights (tensorwise only)
    mxfp8 = false                # MXFP8 linears instead (one e8m0 scale per 32 elements)
    kernels = "auto"             # "emulated" | "hardware"

Why it changes the numbers on purpose: every input of a converted linear's three matmuls
(forward, grad input, grad weight) is scaled and rounded to an 8-bit float (e4m3, 3 mantissa
bits: relative rounding 2^-4 = 6%, versus bf16's 2^-8), so a correct run differs from its
bf16 control far beyond any layout's rounding. Such a pair is judged for "as good", not
"equal" (regimes/margin.py, stats/noninferiority.py).

Why emulation is the same recipe: ``emulate=True`` (float8) and ``KernelPreference.EMULATED``
(mxfp8) quantise and dequantise exactly as the hardware path does and only run the matmul in
high precision, so CPU CI exercises the scales and the rounding a GPU run has; the hardware
path differs from it by the matmul's accumulation order only.

Why these modules: torchtitan's converters leave the output projection (the LM head) in high
precision by default (its logits set the loss directly and it is the least tolerant of 8-bit
inputs), and torchao's float8 matmuls need both dims divisible by 16; the same filter on CPU
and GPU keeps an emulated run and a hardware run the same model.

Why before FSDP and on the meta device: torchao swaps ``nn.Linear`` for ``Float8Linear`` (or a
weight for a wrapper tensor) in place; FSDP2 must see the swapped weights to all-gather them
in float8 (``enable_fsdp_float8_all_gather``), as torchtitan applies its converters first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from convergence.spec.errors import SpecError
from convergence.torchao_info import INSTALL, torchao_installed
from convergence.trainer.config import TrainConfig
from convergence.trainer.precision_here import enabled

#: Compute capability from which torch has hardware float8 matmuls (Ada, Hopper) and MXFP8
#: ones (Blackwell).
FLOAT8_CAPABILITY = (8, 9)
MXFP8_CAPABILITY = (10, 0)


def has_hardware(cfg: TrainConfig, device: torch.device) -> bool:
    """The device multiplies this recipe's 8-bit inputs in hardware."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    need = MXFP8_CAPABILITY if cfg.precision.mxfp8 else FLOAT8_CAPABILITY
    return torch.cuda.get_device_capability(device) >= need


def emulate(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the matmuls are emulated: ``auto`` emulates where the device has no hardware
    path; ``hardware`` without one is an error rather than a silent fallback (a GPU acceptance
    run must measure the hardware kernels it claims to)."""
    kernels = cfg.precision.kernels
    if kernels == "emulated":
        return True
    hardware = has_hardware(cfg, device)
    if kernels == "hardware" and not hardware:
        recipe = "mxfp8" if cfg.precision.mxfp8 else f"float8 {cfg.precision.float8}"
        need = MXFP8_CAPABILITY if cfg.precision.mxfp8 else FLOAT8_CAPABILITY
        raise SpecError(
            f"{recipe} with hardware kernels needs a CUDA GPU of compute capability >= "
            f"{need[0]}.{need[1]}; this job runs on {device}",
            file=cfg.source,
            key="precision.kernels",
            fix='set precision.kernels = "auto" (emulated here) or run on such a GPU',
        )
    return not hardware


def _converted(module: nn.Module, fqn: str) -> bool:
    """The linears converted (see the module docstring: not the LM head; dims % 16 == 0)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module, cfg: TrainConfig, device: torch.device) -> None:
    """Swap the model's linears for torchao's float8 or MXFP8 ones, in place (meta device)."""
    if not enabled(cfg):
        return
    if not torchao_installed():
        raise SpecError(
            "precision techniques need torchao, which is not installed",
            file=cfg.source,
            key="precision",
            fix=INSTALL,
        )
    emulated = emulate(cfg, device)
    # torchao's import logs a warning for each CUDA extension it cannot load: on a CPU build
    # (or a GPU without them) that is every one of them, and says nothing about this run.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # And torchao 0.18 registers an Enum as a pytree constant, which torch 2.13 deprecates
    # with a warning on every rank: torchao's to fix, not this run's.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    if cfg.precision.mxfp8:
        _convert_mxfp8(model, emulated=emulated)
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    base = Float8LinearConfig.from_recipe_name(cfg.precision.float8)
    config = Float8LinearConfig(
        **{
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            "emulate": emulated,
            "enable_fsdp_float8_all_gather": cfg.precision.float8_all_gather,
        }
    )
    convert_to_float8_training(model, config=config, module_filter_fn=_converted)


def _convert_mxfp8(model: nn.Module, *, emulated: bool) -> None:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    # out_dtype None: the matmul returns its input's dtype (the FSDP compute dtype), as an
    # unconverted linear would; the recipe's default bf16 would cast an fp32 control's.
    config = MXFP8TrainingOpConfig(
        kernel_preference=KernelPreference.EMULATED if emulated else KernelPreference.AUTO,
        out_dtype=None,
    )
    quantize_(model, config, filter_fn=_converted)


def after_optimizer_step(chunks: Sequence[nn.Module], cfg: TrainConfig) -> None:
    """With float8 all-gather, recompute every converted weight's scale from the new weights
    in one all-reduce of the amaxes, as torchtitan does after each step: without it each
    FSDP all-gather would compute the scale itself (correct, slower); a scale left over from
    before the step is the "stale scale" bug of benchmarks/detection."""
    if not cfg.precision.float8_all_gather:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for chunk in chunks:
        precompute_float8_dynamic_scale_for_fsdp(chunk)

"""Planted float8 bugs: each is wrong the way a real low-precision bug is (docs/precision.md).

Applied as hooks on a test side that also sets ``techniques = { float8 = ... }``; they patch
torchao inside the trainer's ranks (each job's ranks are fresh processes, so a patch never
leaks into another job).
"""

from __future__ import annotations

import torch
from torch import nn

from convergence.trainer.hooks import HookContext

#: How much smaller than the true amax the planted amax is: the amax of one of 4 shards of a
#: tensor whose largest values sit in another shard.
LOCAL_AMAX_SHRINK = 4.0


def local_amax_scale(model: nn.Module, ctx: HookContext) -> None:
    """The amax of a sharded tensor taken from the local shard only (where the recipe needs
    the global one): every float8 scale is computed from an amax LOCAL_AMAX_SHRINK times too
    small, so the scale is that much too large and every value above amax / LOCAL_AMAX_SHRINK
    saturates at the format's maximum (to_fp8_saturated) -- the largest activations, weights
    and gradients of every converted matmul are clipped, silently."""
    from torchao.float8 import float8_utils

    true_amax_to_scale = float8_utils.amax_to_scale

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def local_only(amax: torch.Tensor, float8_dtype: torch.dtype, **kwargs: object) -> torch.Tensor:
        return true_amax_to_scale(amax / LOCAL_AMAX_SHRINK, float8_dtype, **kwargs)  # type: ignore[arg-type]

    # tensor_to_scale looks the function up in its module at each call.
    float8_utils.amax_to_scale = local_only


def grads_e4m3(model: nn.Module, ctx: HookContext) -> None:
    """Gradients cast to the forward format (e4m3: 4 exponent bits) instead of e5m2 (5): the
    gradient of each converted matmul's output keeps 3 mantissa bits but loses half its
    exponent range, so with one scale per tensor its small entries (relative to the amax)
    flush to zero -- the recipe's typo of ``float8_dtype`` for the backward casts.

    Harmless on the debug model (BENCHMARKS.md, "Precision techniques"): its gradients span
    less than e4m3's range, so it flushes 2-5 in 10,000 of their entries and its extra mantissa bit
    halves the weight gradients' error against e5m2's; it is planted for models whose
    gradients span more than 2^17 within one tensor, where it loses them. None of the 7 other
    configurations measured (larger vocabularies, near-deterministic languages, real text, 200
    steps, 16x the tokens: BENCHMARKS.md, "e4m3 gradients on other models and data") is one:
    e4m3 flushes at most 5e-6 of their gradients' |g| mass and stays the more accurate cast."""
    import dataclasses

    from torchao.float8.config import Float8LinearConfig

    for module in model.modules():
        config = getattr(module, "config", None)
        if not isinstance(config, Float8LinearConfig):
            continue
        wrong = {
            name: dataclasses.replace(getattr(config, name), target_dtype=torch.float8_e4m3fn)
            for name in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")
        }
        module.config = dataclasses.replace(config, **wrong)


def grads_cast_e4m3(model: nn.Module, ctx: HookContext) -> None:
    """The gradients' scale computed for e5m2 (the format the recipe asks for them:
    ``amax_to_scale`` gives 57344 / amax) but the bits cast to e4m3fn (largest value 448): the
    cast's format mixed up with the scale's -- e.g. a kernel that hard-codes the forward's
    e4m3 while the scale follows ``cast_config_grad_output``. Each gradient is scaled so that
    its amax lands on 57344, and ``to_fp8_saturated`` clamps everything above 448, i.e. every
    entry of |g| above amax / 128 comes back as amax / 128: the large gradient entries of every
    converted linear's backward (the input's and the weight's gradient matmuls) are clipped,
    silently. Unlike ``grads_e4m3`` (a consistent e4m3 recipe: its scale is e4m3's) this is
    not a format choice but a broken cast."""
    from torchao.float8 import float8_linear
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import (
        Float8TrainingTensor,
        GemmInputRole,
        LinearMMConfig,
        hp_tensor_and_scale_to_float8,
    )
    from torchao.float8.float8_utils import tensor_to_scale

    right_cast = float8_linear.hp_tensor_to_float8_dynamic

    # torchao 0.18's signature of hp_tensor_to_float8_dynamic (float8_scaling_utils.py).
    def mixed_cast(
        hp_tensor: torch.Tensor,
        float8_dtype: torch.dtype,
        linear_mm_config: LinearMMConfig,
        reduce_amax: bool = False,
        gemm_input_role: GemmInputRole = GemmInputRole.INPUT,
        device_mesh: object = None,
        scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
        axiswise_dim: int | None = None,
        round_scales_to_power_of_2: bool = False,
    ) -> Float8TrainingTensor:
        if float8_dtype is not torch.float8_e5m2:  # the forward's e4m3 casts stay right
            return right_cast(
                hp_tensor,
                float8_dtype,
                linear_mm_config,
                reduce_amax,
                gemm_input_role,
                device_mesh,
                scaling_granularity,
                axiswise_dim,
                round_scales_to_power_of_2,
            )
        scale = tensor_to_scale(
            hp_tensor,
            float8_dtype,  # the scale as for e5m2: 57344 / amax
            reduce_amax,
            device_mesh,
            scaling_granularity,
            axiswise_dim,
            round_scales_to_power_of_2,
        )
        # ... the bits in e4m3fn. Downstream torchao reads the format from the bits
        # (``_data.dtype``) and checks none against the config: the matmuls (emulated:
        # ``_data.float() / _scale``; hardware: ``_scaled_mm`` takes e4m3 x e4m3) run on it.
        return hp_tensor_and_scale_to_float8(
            hp_tensor, scale, torch.float8_e4m3fn, linear_mm_config, gemm_input_role, axiswise_dim
        )

    # Float8Linear's backward (float8_linear.py, matmul_with_hp_or_float8_args.backward) looks
    # the name up in its module at each call: the grad_output casts for the input's gradient
    # and for the weight's gradient both go through it; only the backward asks for e5m2. The
    # patch lives in this rank's process only: each job's ranks are fresh processes, so it
    # never reaches another job (the control's ranks import an unpatched torchao).
    float8_linear.hp_tensor_to_float8_dynamic = mixed_cast


def stale_scales(model: nn.Module, ctx: HookContext) -> None:
    """With float8 all-gather, the weights' float8 scales computed once and not recomputed
    after the optimizer steps (``precompute_float8_dynamic_scale_for_fsdp`` called for the
    first step only): each all-gather casts the updated weights with the first step's scale,
    so weights that grew past their first amax saturate and the others lose precision."""
    import torchao.float8

    precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp
    calls = {"done": False}

    def once(module: nn.Module) -> None:
        if not calls["done"]:
            precompute(module)
            calls["done"] = True

    # trainer/precision.py looks the function up in torchao.float8 after each step.
    torchao.float8.precompute_float8_dynamic_scale_for_fsdp = once


def inverted_weight_scale(model: nn.Module, ctx: HookContext) -> None:
    """A scale applied inverted (multiply for divide) on one side of a matmul: the float8
    weight's scale is multiplied into the product instead of divided out of it (the weight
    operand's ``scale`` passed where the kernel takes its inverse, ``1 / scale``), so every
    matmul with the weight -- the forward and the input's gradient -- comes out scale^2 times
    too large (scale = 448 / amax(weight)); the weight's gradient matmul (gradient and
    input, no weight) stays right. The recipe's sign slip in
    ``addmm_float8_unwrapped``'s ``scale_b=b_inverse_scale``."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    def inverted(op: object) -> object:
        def call(aten_op: object, args: tuple[object, ...], kwargs: object = None) -> object:
            b = args[1]
            if isinstance(b, Float8TrainingTensor) and b._gemm_input_role is GemmInputRole.WEIGHT:
                # The kernel divides by the scale it is given: give it 1 / scale, and the
                # weight's scale is multiplied in.
                b = Float8TrainingTensor(
                    b._data,
                    b._scale.reciprocal(),
                    b._orig_dtype,
                    b._linear_mm_config,
                    b._gemm_input_role,
                    b._axiswise_dim,
                )
            return op(aten_op, (args[0], b, *args[2:]), kwargs)  # type: ignore[operator]

        return call

    table = float8_ops.FLOAT8_OPS_TABLE
    # Float8TrainingTensor.__torch_dispatch__ looks each op up in this table at each call.
    for op in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
        if op in table:
            table[op] = inverted(table[op])

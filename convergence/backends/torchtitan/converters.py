"""The pair's precision techniques (``techniques.float8`` / ``mxfp8``) as torchtitan's own
converters, on the rank side: the parsed config's model config tree is converted before
torchtitan builds the model, as torchtitan's ``model_registry(..., converters=[...])`` does.

What torchtitan 0.3.0 offers, and why the rest is refused rather than approximated (each
refusal names the key and the fix; the backend's preflight makes the same decision at
collection, :func:`refusal`):

- ``Float8LinearConverter`` has the recipes ``rowwise`` and ``rowwise_with_gw_hp`` for the
  GPU's float8 kernels, and ``emulate=True`` for other devices -- but emulation replaces the
  recipe with torchao's default config (tensorwise scaling; torchtitan's float8.py). So on CPU
  ``float8 = "tensorwise"`` is what runs, and on a GPU ``float8 = "rowwise"``; the other two
  combinations would silently train another recipe than the one the pair names.
- no float8 all-gather option (``float8_all_gather``): the built-in trainer has it.
- ``MXFP8LinearConverter`` needs an SM100 GPU (no emulation).

The LM head (``output``) stays in high precision, as in the built-in trainer
(convergence/trainer/precision.py): the two backends convert the same linears.
"""

from __future__ import annotations

from typing import Any

#: The linears both backends leave unconverted.
KEEP_HIGH_PRECISION = ("output",)


def refusal(*, float8: str, mxfp8: bool, cpu: bool) -> str | None:
    """Why torchtitan 0.3.0 cannot train these techniques on this device (None: it can).
    float8 all-gather, which no device has in 0.3.0, is the preflight's error of the file."""
    if mxfp8 and cpu:
        return "techniques.mxfp8: torchtitan 0.3.0's MXFP8 converter needs an SM100 GPU"
    if float8 == "rowwise" and cpu:
        return (
            'techniques.float8 = "rowwise": without a float8 GPU torchtitan 0.3.0 emulates '
            'tensorwise scaling only (its emulate option drops the recipe): use "tensorwise" '
            "here, rowwise on a GPU"
        )
    if float8 == "tensorwise" and not cpu:
        return (
            'techniques.float8 = "tensorwise": torchtitan 0.3.0 has only row-wise float8 '
            'recipes on a GPU: use "rowwise" there (tensorwise runs emulated on CPU)'
        )
    return None


def convert_model(config: Any, *, float8: str, mxfp8: bool, cpu: bool) -> None:
    """Convert ``config.model_spec.model`` with torchtitan's converter for the techniques
    (nothing when neither is set); SystemExit with the reason where :func:`refusal` says no."""
    if float8 in ("", "none") and not mxfp8:
        return
    why = refusal(float8=float8, mxfp8=mxfp8, cpu=cpu)
    if why is not None:
        raise SystemExit(f"convergence.backends.torchtitan.launch: {why}")
    from torchtitan.components.quantization import Float8LinearConverter, MXFP8LinearConverter

    converter: Any
    if mxfp8:
        converter = MXFP8LinearConverter.Config(fqns=["layers"])
    else:
        converter = Float8LinearConverter.Config(
            recipe_name="rowwise",  # the GPU's; with emulate, torchao's tensorwise default
            emulate=cpu,
            filter_fqns=list(KEEP_HIGH_PRECISION),
            model_compile_enabled=False,
        )
    spec = config.model_spec
    spec.model = converter.build().convert(spec.model)

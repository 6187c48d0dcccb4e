"""The forward-noise twin's perturbations (convergence/trainer/forward_noise.py), on the real
model in bf16: the row-wise linears' outputs and the column-wise linears' input gradients are
re-rounded at the unit roundoff, and nothing is without the twin's amplitude."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from convergence.trainer.config import load_train_config
from convergence.trainer.forward_noise import (
    RE_ROUNDED,
    RE_ROUNDED_BACKWARD,
    UNIT_ROUNDOFF,
    add_forward_noise,
)
from convergence.trainer.model import ModelArgs, build_model

DEBUG = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"
U = UNIT_ROUNDOFF["bfloat16"]


def bf16_model() -> torch.nn.Module:
    cfg = load_train_config(DEBUG, [])
    model = build_model(ModelArgs.from_config(cfg.model, seq_len=32), "cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.to(torch.bfloat16)


def input_gradients(amplitude: float) -> tuple[int, dict[str, tuple[Any, Any]]]:
    """Per column-wise linear: the gradient the rest of the network receives for its input
    (a tap registered before the twin's hook) and the gradient the layer itself produced (a
    tap registered after it, right at the layer)."""
    model = bf16_model()
    taps: dict[str, list[Any]] = {}

    def tap(name: str) -> Any:
        def hook(module: Any, inputs: tuple[Any, ...]) -> Any:
            x = inputs[0].view_as(inputs[0])
            x.retain_grad()
            taps.setdefault(name, []).append(x)
            return (x, *inputs[1:])

        return hook

    column = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in RE_ROUNDED_BACKWARD
    ]
    for name, module in column:
        module.register_forward_pre_hook(tap(name))
    count = add_forward_noise([model], amplitude, seed=7) if amplitude else 0
    for name, module in column:
        module.register_forward_pre_hook(tap(name))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = model(tokens).float()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return count, {name: (x.grad, y.grad) for name, (x, y) in taps.items()}


def test_the_twin_re_rounds_the_column_wise_linears_input_gradients_at_the_unit_roundoff() -> None:
    count, grads = input_gradients(U)
    layers = load_train_config(DEBUG, []).model.n_layers
    assert count == layers * (len(RE_ROUNDED) + len(RE_ROUNDED_BACKWARD))
    assert len(grads) == layers * len(RE_ROUNDED_BACKWARD)
    for name, (received, produced) in grads.items():
        assert received.dtype == produced.dtype == torch.bfloat16
        ratio = received.float() / produced.float()
        ratio = ratio[produced != 0]
        # One re-rounding: within the amplitude plus bf16's own rounding of the product...
        assert (ratio - 1).abs().max().item() <= 2 * U + 1e-6, name
        # ...and a real change, not a no-op: a good share of the elements moved.
        assert (ratio != 1).float().mean().item() > 0.2, name


def test_the_control_passes_the_input_gradients_through_untouched() -> None:
    count, grads = input_gradients(0.0)
    assert count == 0
    for received, produced in grads.values():
        assert torch.equal(received, produced)

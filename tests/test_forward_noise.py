"""The forward-noise twin's perturbations (convergence/trainer/forward_noise.py) in bf16: the
row-wise linears' outputs re-rounded at the unit roundoff, the column-wise linears' input
gradients summed as TP2's two ranks sum them; the control's left alone."""

from __future__ import annotations

from pathlib import Path

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


class Block(torch.nn.Module):
    """A column-wise (wq) and a row-wise (wo) linear, as the model names them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wq = torch.nn.Linear(64, 192, bias=False).to(torch.bfloat16)
        self.wo = torch.nn.Linear(192, 64, bias=False).to(torch.bfloat16)


def backward_through_wq(
    block: Block,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input, output gradient, input gradient, weight gradient) of one call of ``wq``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    y = block.wq(x)
    g = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(g)
    assert x.grad is not None and block.wq.weight.grad is not None
    return x, g, x.grad, block.wq.weight.grad


def test_the_twin_sums_a_column_wise_linears_input_gradient_as_tp2_does() -> None:
    control, twin = Block(), Block()
    assert add_forward_noise([twin], U, seed=7) == 2
    x, g, plain_dx, plain_dw = backward_through_wq(control)
    _, _, twin_dx, twin_dw = backward_through_wq(twin)
    w = twin.wq.weight.detach()
    # Two ranks' partial products over the halves of the output dim, each rounded to bf16, then
    # their sum rounded: bitwise what the twin computes.
    assert torch.equal(twin_dx, g[..., :96] @ w[:96] + g[..., 96:] @ w[96:])
    # A rounding-level change of a good share of the elements, no more.
    moved = twin_dx != plain_dx
    assert 0.05 < moved.float().mean().item() < 0.9
    rel = (twin_dx.float() - plain_dx.float()).norm() / plain_dx.float().norm()
    assert 0 < rel.item() < 4 * U
    # The forward and the weight gradient are the control's, bit for bit.
    assert torch.equal(twin.wq(x.detach()), control.wq(x.detach()))
    assert torch.equal(twin_dw, plain_dw)


def test_the_twin_re_rounds_the_row_wise_outputs_at_the_unit_roundoff() -> None:
    control, twin = Block(), Block()
    add_forward_noise([twin], U, seed=7)
    h = torch.randn(2, 32, 192, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    plain, noisy = control.wo(h).float(), twin.wo(h).float()
    ratio = (noisy / plain)[plain != 0]
    assert (ratio - 1).abs().max().item() <= 2 * U + 1e-6
    assert (ratio != 1).float().mean().item() > 0.1


def test_the_real_models_re_rounded_linears_are_the_named_ones() -> None:
    cfg = load_train_config(DEBUG, [])
    model = build_model(ModelArgs.from_config(cfg.model, seq_len=32), "cpu")
    count = add_forward_noise([model], U, seed=7)
    layers = cfg.model.n_layers
    # wo, w2 per block; wq, wk, wv, w1, w3 per block and the vocab-sharded output projection
    assert count == layers * len(RE_ROUNDED) + layers * (len(RE_ROUNDED_BACKWARD) - 1) + 1
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())
